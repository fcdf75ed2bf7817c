"""Config loading: shipped configs validate, overrides apply, bad input names the field."""
from pathlib import Path

import pytest
import yaml

from k3train.config import ConfigError, load_config
from k3train.trainer.run_dir import save_config
from k3train.config.layer_pattern import expand_layer_pattern

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    load_config(path)


def test_overrides_parse_yaml_scalars():
    cfg = load_config("configs/k3_tiny.yaml", ["train.steps=7", "optim.lr=1e-4", "model.attnres.enabled=false",
                                               "optim.name=muon"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-4
    assert cfg.model.attnres.enabled is False and cfg.optim.name == "muon"


@pytest.mark.parametrize("override, message", [
    (["model.hiden_size=3"], "unknown config key 'model.hiden_size'; allowed keys here: attnres"),
    (["optim.name=sgd"], "optim.name: Input should be 'adamw' or 'muon'"),
    (["train.steps=0"], "train.steps: Input should be greater than or equal to 1"),
    (["moe.topk=8"], "moe.topk (8) must be smaller than moe.num_experts (8)"),
    (["model.layer_pattern=KKX"], "term 'KKX' of 'KKX' is not letters K/M"),
    (["model.num_layers=6"], "does not tile model.num_layers=6"),
    (["precision.recipe=fp4"], "precision.recipe: Input should be"),
    (["precision.recipe=mxfp4_qat", "moe.latent_size=48"], "{'moe.latent_size': 48} must be multiples of 32"),
    (["train.steps"], "is not of the form key.sub=value"),
    (["train.steps.x=1"], "'steps' is a value, not a section"),
], ids=["unknown-key", "bad-enum", "range", "cross-field", "pattern-letter", "pattern-length",
        "recipe", "mx-block", "no-equals", "value-as-section"])
def test_bad_input_names_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/k3_tiny.yaml", override)
    assert message in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("configs/k3_tiny.yaml", ["train.steps=3"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 3


def test_stable_user_config_keys_exist():
    keys = ["train.steps", "train.seed", "train.microbatches", "parallel.tp", "parallel.pp", "parallel.vpp",
            "parallel.ep", "model.attnres.enabled", "model.attnres.block_size", "model.layer_pattern",
            "moe.balancing", "optim.name", "precision.recipe", "checkpoint.interval"]
    dumped = load_config(None).model_dump()
    for key in keys:
        node = dumped
        for part in key.split("."):
            node = node[part]


@pytest.mark.parametrize("pattern, n, expected", [
    ("KKKM", 8, "KKKMKKKM"), ("KKKM*2+KKM", 11, "KKKMKKKMKKM"), ("M", 3, "MMM"),
])
def test_layer_pattern_expansion(pattern, n, expected):
    assert "".join(expand_layer_pattern(pattern, n)) == expected


def test_full_k3_pattern_is_69_kda_24_mla_ending_in_mla():
    cfg = load_config("configs/k3_full.yaml")
    layers = expand_layer_pattern(cfg.model.layer_pattern, cfg.model.num_layers)
    assert layers.count("K") == 69 and layers.count("M") == 24 and layers[-1] == "M"


def _fields_of_type(model_cls, wanted, prefix=()):
    """Dotted paths of every field of ``model_cls`` (recursively) whose type is ``wanted`` or
    ``wanted | None``: walked from the schema itself, so a new field is covered automatically."""
    from pydantic import BaseModel

    out = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _fields_of_type(ann, wanted, (*prefix, name))
        elif ann is wanted or set(getattr(ann, "__args__", ())) == {wanted, type(None)}:
            out.append(".".join((*prefix, name)))
    return out


def test_every_float_field_refuses_inf_and_nan():
    from k3train.config.schema import RunConfig

    paths = _fields_of_type(RunConfig, float)
    # The walk itself must find the fields the issue was about (and more than a handful).
    assert {"optim.lr", "train.grad_clip", "moe.capacity_factor", "model.kda.gate_lower_bound"} <= set(paths)
    assert len(paths) >= 15
    for path in paths:
        for value in (".inf", "-.inf", ".nan"):
            with pytest.raises(ConfigError, match=rf"{path}: Input should be a finite number"):
                load_config("configs/k3_tiny.yaml", [f"{path}={value}"])


def test_int_and_float_fields_refuse_booleans():
    from k3train.config.schema import RunConfig

    paths = _fields_of_type(RunConfig, int) + _fields_of_type(RunConfig, float)
    assert "model.hidden_size" in paths and "optim.lr" in paths
    for path in paths:
        with pytest.raises(ConfigError, match=rf"{path}: expected a number, not a boolean"):
            load_config("configs/k3_tiny.yaml", [f"{path}=true"])
    # Fields typed bool (or bool | "auto") still take booleans.
    cfg = load_config("configs/k3_tiny.yaml", ["model.attnres.enabled=false", "train.cuda_graph=false"])
    assert cfg.model.attnres.enabled is False and cfg.train.cuda_graph is False


def test_layer_pattern_refuses_a_zero_repeat():
    with pytest.raises(ValueError, match=r"term 'KM\*0' of 'KM\*0\+KKKM' repeats its unit 0 times"):
        expand_layer_pattern("KM*0+KKKM", 4)
    assert expand_layer_pattern("KM*1+KK", 4) == list("KMKK")  # a repeat of 1 is fine


def test_fp8_recipe_offers_only_what_runs():
    """torchao runs only dynamic (current) scaling; TE's delayed/blockwise need fp8_backend=te
    (tests/quant/test_te_backend.py)."""
    assert load_config("configs/k3_tiny.yaml", ["precision.fp8_recipe=current"]).precision.fp8_recipe == "current"
    with pytest.raises(ConfigError, match=r"precision.fp8_recipe=delayed needs precision.fp8_backend=te"):
        load_config("configs/k3_tiny.yaml", ["precision.fp8_recipe=delayed"])
    with pytest.raises(ConfigError, match=r"precision.fp8_recipe: Input should be 'current', 'delayed' or 'blockwise'"):
        load_config("configs/k3_tiny.yaml", ["precision.fp8_recipe=block"])


# Layout rules: refused when the config loads, each as one line that names the field, what is
# wrong and what is allowed (k3train.config.layout_rules.layout_refusal; the rules needing the world size are in
# k3train.runtime.distributed.check_layout).
LAYOUT_REFUSALS = {
    "cp-with-cuda-graph": (["parallel.cp=2", "train.cuda_graph=true"], "parallel.cp",
                           "parallel.cp=2 with train.cuda_graph=true: not wired yet",
                           "change train.cuda_graph or use parallel.cp=1"),
    "cp-seq-len": (["parallel.cp=3", "train.seq_len=64"], "train.seq_len",
                   "train.seq_len=64 is not divisible by parallel.cp=3", "use a multiple of 3"),
    "cp-too-short": (["parallel.cp=32", "train.seq_len=64"], "train.seq_len",
                     "leaves 2 tokens per rank, fewer than the 3 the short convolution's halo needs",
                     "use a longer seq_len or a smaller cp"),
    "cp-head-tail-seq-len": (["parallel.cp=4", "parallel.cp_partition=head_tail", "train.seq_len=36"],
                             "train.seq_len", "train.seq_len=36 is not divisible by 2 * parallel.cp=8",
                             "use a multiple of 8 or parallel.cp_partition=contiguous"),
    "cp-head-tail-too-short": (["parallel.cp=16", "parallel.cp_partition=head_tail", "train.seq_len=64"],
                               "train.seq_len", "leaves 2 tokens per head_tail piece, fewer than the 3",
                               "use a longer seq_len or a smaller cp"),
    "vpp-without-pp": (["parallel.vpp=2"], "parallel.vpp",
                       "parallel.vpp=2 needs parallel.pp > 1", "set parallel.vpp=1 or parallel.pp >= 2"),
    "interleave-microbatches": (["parallel.pp=2", "parallel.vpp=2", "train.microbatches=3"], "train.microbatches",
                                "train.microbatches=3 cannot run the interleaved schedule",
                                "use a multiple of 2, at least 2, or parallel.vpp=1"),
    "tied-over-pp": (["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings",
                     "needs the embedding and the head on one pipeline rank", "set model.tie_embeddings=false"),
    "ep-with-tp": (["parallel.ep=2", "parallel.tp=2"], "parallel.ep",
                   "parallel.ep=2 together with parallel.tp=2 is not supported yet", "use parallel.tp=1 with ep"),
    "experts-over-ep": (["parallel.ep=3"], "moe.num_experts",
                        "moe.num_experts=8 is not divisible by parallel.ep=3", "use an ep that divides it"),
    "local-with-ep": (["moe.dispatcher=local", "parallel.ep=2"], "moe.dispatcher",
                      "moe.dispatcher=local cannot run with parallel.ep=2", "use moe.dispatcher=grouped_a2a or auto"),
    "local-with-capacity": (["moe.dispatcher=local", "moe.capacity_factor=1.5"], "moe.capacity_factor",
                            "moe.capacity_factor=1.5 needs moe.dispatcher=grouped_a2a or auto",
                            "unset it or change the dispatcher"),
    "graph-tp": (["train.cuda_graph=true", "parallel.tp=2"], "train.cuda_graph",
                 "train.cuda_graph cannot capture parallel.tp=2 (megatron-core's tensor-parallel linears run "
                 "their collectives eagerly); it needs parallel.tp=1", "set train.cuda_graph=false (or auto)"),
    "graph-ep": (["train.cuda_graph=true", "parallel.ep=2"], "train.cuda_graph",
                 "cannot capture parallel.ep=2 with the dynamic dispatcher (it reads its all-to-all split "
                 "sizes on the host)", "set moe.capacity_factor (the static dispatcher) or parallel.ep=1"),
    "graph-cpu": (["train.cuda_graph=true", "train.device=cpu"], "train.cuda_graph",
                  "train.cuda_graph needs a CUDA device, this run is on cpu (train.device=cpu)",
                  "set train.cuda_graph=false (or auto)"),
}


@pytest.mark.parametrize("overrides, field, wrong, allowed", LAYOUT_REFUSALS.values(),
                         ids=LAYOUT_REFUSALS.keys())
def test_layout_refusals_name_the_field_in_one_line(overrides, field, wrong, allowed):
    with pytest.raises(ConfigError) as err:
        load_config("configs/k3_tiny.yaml", overrides)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"invalid config: {field}")
    assert wrong in message and allowed in message


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=2", "parallel.vpp=2", "train.microbatches=2"],
    ["parallel.ep=2", "moe.dispatcher=grouped_a2a", "moe.capacity_factor=1.25"],
    ["parallel.ep=4", "parallel.pp=2"],
    ["parallel.tp=2", "parallel.pp=2"],
    ["parallel.ep=3", "model.dense_layers=8"],   # no MoE layer: ep need not divide the experts
    ["train.cuda_graph=auto", "parallel.ep=2"],   # auto: off, not refused
    ["train.cuda_graph=true", "train.device=cuda", "data.document_mask=false"],
    ["train.cuda_graph=true", "parallel.pp=2", "precision.recipe=fp8", "data.document_mask=false"],  # chunk graphs
    ["train.cuda_graph=true", "parallel.ep=2", "moe.capacity_factor=1.25", "data.document_mask=false"],  # static
    ["parallel.cp=2", "parallel.ep=2", "optim.zero1=true", "moe.balancing=aux_loss"],
    ["parallel.cp=2", "parallel.tp=2", "optim.name=muon"],
], ids=["pp-vpp", "ep-static", "ep-pp", "tp-pp", "dense-ep", "graph-auto", "graph-on", "graph-pp-fp8",
        "graph-ep-static", "cp-ep-zero1-aux", "cp-tp"])
def test_valid_layouts_load(overrides):
    cfg = load_config("configs/k3_tiny.yaml", overrides)
    for text in overrides:
        key, value = text.split("=")
        section, field = key.split(".")
        assert str(getattr(getattr(cfg, section), field)).lower() == value.lower()


def test_a_config_with_several_mistakes_lists_each_on_its_line():
    with pytest.raises(ConfigError) as err:
        load_config("configs/k3_tiny.yaml", ["train.steps=0", "optim.lr=-1"])
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 3
    assert sorted(line.strip().split(":")[0] for line in lines[1:]) == ["optim.lr", "train.steps"]


def test_graph_blockers_are_one_list_for_load_time_and_run_time():
    """The trainer asks the same list with the device it knows (use_cuda_graph)."""
    cfg = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "parallel.tp=2", "data.document_mask=false"])
    assert set(cfg.cuda_graph_blockers()) == {"parallel.tp"}
    assert set(cfg.cuda_graph_blockers(device="cpu")) == {"parallel.tp", "train.device"}
    assert cfg.cuda_graph_refusal(device="cuda").endswith("set train.cuda_graph=false (or auto)")
    plain = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "data.document_mask=false"])
    assert plain.cuda_graph_blockers(device="cuda") == {} and plain.cuda_graph_refusal(device="cuda") is None
    # Document masking is recorded below the per-document attention's window, not from it, by
    # the whole-step graph and by the pipeline's chunk graphs alike.
    masked = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto"])
    assert masked.data.masks_documents and masked.cuda_graph_blockers(device="cuda") == {}
    assert masked.cuda_graph_blockers(device="cuda", auto=True) == {}
    long = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "train.seq_len=16384"])
    assert set(long.cuda_graph_blockers(device="cuda")) == {"data.document_mask"}
    assert "16384" in long.cuda_graph_blockers(device="cuda")["data.document_mask"]
    short = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "train.seq_len=16320"])
    assert short.cuda_graph_blockers(device="cuda") == {}
    piped = load_config("configs/k3_tiny.yaml", ["train.cuda_graph=auto", "parallel.pp=2"])
    assert piped.cuda_graph_blockers(device="cuda") == {}
    assert piped.cuda_graph_blockers(device="cuda", auto=True) == {}


def test_recompute_modes_are_defined_once():
    from typing import get_args

    from k3train.config.schema import RECOMPUTE_MODES, TrainConfig
    from k3train.model import recompute
    from k3train.profiling import memory_plan

    assert RECOMPUTE_MODES == ("none", "selective", "full")
    assert get_args(TrainConfig.model_fields["recompute"].annotation) == RECOMPUTE_MODES
    assert recompute.RECOMPUTE_MODES is RECOMPUTE_MODES and memory_plan.MODES is RECOMPUTE_MODES
    with pytest.raises(ConfigError, match=r"train.recompute: Input should be 'none', 'selective' or 'full'"):
        load_config("configs/k3_tiny.yaml", ["train.recompute=some"])
