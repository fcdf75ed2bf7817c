"""ISSUE44 item 5: ``k3train import`` validates before it writes. Each hostile directory is made
here from one real small export (``export-hf`` of a random tiny model): wrong dtypes,
non-finite values, ``weight_map`` paths leading out of the directory (``..``, absolute, a
symlink), HF fields contradicting the ``k3train`` section, invalid section fields, a missing,
unloadable, foreign or changed tokenizer, a non-UTF-8 or non-object config.json. Each is one
line (exit status 2), names the file, field or tensor, and writes nothing (the parent directory
is listed before and after). A good export with a BPE tokenizer imports with its own copy."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3train.cli import main
from k3train.config import load_config
from k3train.data.tokenizer import load_tokenizer
from k3train.data.train_tokenizer import train_bpe
from k3train.model.model import build_model
from k3train.runtime.distributed import init_distributed, shutdown_distributed
from k3train.trainer.checkpoint import save_checkpoint
from k3train.trainer.run_dir import save_config
from tests.helpers import SMALL

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"


def _cfg(*extra):
    """The small test model on CPU (expert sizes divisible by 32, as the export's MX blocks need)."""
    return load_config("configs/k3_tiny.yaml", [*SMALL, "train.device=cpu", *extra])


def _export(root, *extra, cfg_extra=()):
    """``export-hf`` of a random ``_cfg(*cfg_extra)`` model's one-process checkpoint into ``root/hf``."""
    cfg = _cfg(*cfg_extra)
    model = build_model(cfg)
    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.2)
    run = root / "run"
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 3, {"step": 3, "model": model.state_dict()},
                    layout={"world_size": 1}, coords={"pp": 0, "tp": 0, "ep": 0, "dp": 0})
    assert main(["export-hf", "--checkpoint", str(run / "checkpoints"), "--out", str(root / "hf"), *extra]) == 0


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """One real export (float32, two shards), copied by each test before it damages it."""
    root = tmp_path_factory.mktemp("export")
    init_distributed()
    try:
        _export(root, "--shard-size", "200KB")
    finally:
        shutdown_distributed()
    return root / "hf"


@pytest.fixture
def hf(export, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(export, work / "hf")
    return work / "hf"


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(hf, capsys, *needles):
    """Import ``hf``: one line naming every needle, exit status 2, nothing written."""
    root = hf.parent
    before = _listing(root)
    capsys.readouterr()
    assert main(["import", str(hf), "--out", str(root / "imported")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3train: error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert _listing(root) == before
    return err


def _shard_of(hf, name):
    return hf / json.loads((hf / INDEX).read_text())["weight_map"][name]


def _edit_tensor(hf, name, edit):
    shard = _shard_of(hf, name)
    tensors = load_file(str(shard))
    tensors[name] = edit(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_untouched_export_imports(hf, capsys):
    assert main(["import", str(hf), "--out", str(hf.parent / "run")]) == 0
    assert load_config(hf.parent / "run" / "config.yaml").model == _cfg().model


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float64])
def test_a_tensor_of_another_dtype_is_refused_not_cast(hf, capsys, dtype):
    _edit_tensor(hf, EMBED, lambda t: (t * 1000).to(dtype))
    _refused(hf, capsys, EMBED, f"is {str(dtype).removeprefix('torch.')}", "torch_dtype declares float32")


@pytest.mark.parametrize("declared", ["float64", "save", None])
def test_an_unknown_torch_dtype_is_refused(hf, capsys, declared):
    _edit_json(hf / "config.json", lambda c: c.update(torch_dtype=declared))
    _refused(hf, capsys, "config.json: torch_dtype is", repr(declared))


def _poison(value):
    def edit(t):
        t = t.clone()
        t.view(-1)[7] = value
        return t
    return edit


def _exponent_all_ones(t):
    """Bits 23..30 of element 7 set: the value becomes inf or NaN."""
    t = t.clone()
    bits = t.view(-1).view(torch.int32)
    bits[7] |= 0x7F800000
    return t


@pytest.mark.parametrize("edit", [_poison(float("nan")), _poison(float("-inf")), _exponent_all_ones])
def test_non_finite_weights_are_refused(hf, capsys, edit):
    _edit_tensor(hf, "model.layers.1.self_attn.o_proj.weight", edit)
    _refused(hf, capsys, "layers.1.mixer.o_proj", "1 non-finite value(s)")


def test_weight_map_paths_leading_out_are_refused(hf, capsys):
    index = json.loads((hf / INDEX).read_text())
    shard = index["weight_map"][EMBED]
    outside = hf.parent / "outside.safetensors"
    shutil.copy(hf / shard, outside)
    for path, needle in ((f"../{outside.name}", "leads out of"), (str(outside), "leads out of")):
        _edit_json(hf / INDEX, lambda i: i["weight_map"].update({EMBED: path}))
        _refused(hf, capsys, INDEX, EMBED, repr(path), needle)
    # a symlink inside the directory that points out of it
    (hf / "link.safetensors").symlink_to(outside)
    _edit_json(hf / INDEX, lambda i: i["weight_map"].update({EMBED: "link.safetensors"}))
    _refused(hf, capsys, "a link leading out of")


@pytest.mark.parametrize("field, value", [("hidden_size", 128), ("num_hidden_layers", 8), ("vocab_size", 512),
                                          ("tie_word_embeddings", True), ("n_routed_experts", 8)])
def test_hf_fields_contradicting_the_k3train_section_are_refused(hf, capsys, field, value):
    _edit_json(hf / "config.json", lambda c: c.update({field: value}))
    _refused(hf, capsys, f"config.json: {field} is {value!r}", "k3train section gives")


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s["model"].update(hidden_size=-1), "k3train.model.hidden_size"),
    (lambda s: s["moe"].update(topk="two"), "k3train.moe.topk"),
    (lambda s: s["moe"].update(bogus=1), "k3train.moe.bogus"),
    (lambda s: s.update(data=["byte"]), "k3train.data is a list"),
])
def test_an_invalid_k3train_section_names_the_field(hf, capsys, edit, needle):
    _edit_json(hf / "config.json", lambda c: edit(c["k3train"]))
    _refused(hf, capsys, needle)


def test_a_non_utf8_or_non_object_config_json_is_one_line(hf, capsys):
    config = hf / "config.json"
    good = config.read_bytes()
    config.write_bytes(b"\xff\xfe" + good)
    _refused(hf, capsys, "config.json is not UTF-8")
    config.write_text(json.dumps([json.loads(good)]))
    _refused(hf, capsys, "config.json holds a JSON list, expected an object")


def _bpe_export(tmp_path):
    tok_dir = tmp_path / "tok"
    train_bpe(["the cat sat on the mat. " * 20, "a dog ran; the dog sat."] * 5, 300, tok_dir)
    tok = load_tokenizer(str(tok_dir))
    init_distributed()
    _export(tmp_path, cfg_extra=[f"data.tokenizer={tok_dir}", f"model.vocab_size={tok.vocab_size}"])
    return tmp_path / "hf", tok_dir


def test_a_bpe_tokenizer_is_imported_as_a_copy(tmp_path, capsys):
    hf, tok_dir = _bpe_export(tmp_path)
    shutil.rmtree(tok_dir)  # the exporting machine's path is gone: the import must not need it
    run = tmp_path / "imported"
    assert main(["import", str(hf), "--out", str(run)]) == 0
    spec = load_config(run / "config.yaml").data.tokenizer
    assert spec == str(run / "tokenizer" / "tokenizer.json")
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("tokenizer_file, needle", [
    ("/etc/passwd", "leads out of"),
    ("../tok/tokenizer.json", "leads out of"),
    ("missing.json", "missing.json named by"),
])
def test_a_tokenizer_file_outside_or_missing_is_refused(tmp_path, capsys, tokenizer_file, needle):
    hf, _ = _bpe_export(tmp_path)
    _edit_json(hf / "tokenizer_config.json", lambda t: t.update(k3train_tokenizer_file=tokenizer_file))
    _refused(hf, capsys, "tokenizer", needle)


def test_a_damaged_or_replaced_tokenizer_is_refused(tmp_path, capsys):
    hf, _ = _bpe_export(tmp_path)
    good = (hf / "tokenizer.json").read_bytes()
    (hf / "tokenizer.json").write_text("{not json")
    _refused(hf, capsys, "tokenizer.json cannot be loaded")
    other = json.loads(good)
    other["added_tokens"] = []  # still loadable, but not the tokenizer that was exported
    (hf / "tokenizer.json").write_text(json.dumps(other))
    _refused(hf, capsys, "k3train_tokenizer_hash", "changed after the export")


def test_a_section_naming_a_tokenizer_without_tokenizer_config_is_refused(hf, capsys):
    (hf / "tokenizer_config.json").unlink()
    _edit_json(hf / "config.json", lambda c: c["k3train"]["data"].update(tokenizer="/etc/passwd"))
    _refused(hf, capsys, "no tokenizer_config.json", "/etc/passwd")
