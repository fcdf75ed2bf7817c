"""An export-hf directory loads in transformers: ``AutoConfig`` / ``AutoModelForCausalLM``
(``trust_remote_code``, the exported ``modeling_k3train.py``) rebuild the exact model, whose fp32
CPU logits equal k3train's to 1e-5 with no missing or unexpected tensor; ``AutoTokenizer`` encodes
and decodes as k3train's tokenizer; ``--layout kimi_linear`` refuses, in one line naming each
misfit, a model that transformers' own ``kimi_linear`` cannot compute (and the named gate misfit
is real: transformers' forget gate gives other decays from the same weights).

transformers writes the remote code into its modules cache: every test points that, and the
hub's home, into ``tmp_path``."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.tokenizer_files import write_tiktoken
from k3train.data import embedded_documents
from k3train.data.tokenizer import ByteTokenizer, load_tokenizer
from k3train.data.train_tokenizer import train_bpe
from k3train.errors import UsageError
from k3train.hf.export import export_hf
from k3train.model.model import build_model
from tests.helpers import tiny_cfg

TEXT = "Grüße, 世界! <|endoftext|> tabs\tand\n  two spaces ☃"


@pytest.fixture
def transformers_home(tmp_path, monkeypatch):
    """transformers, with its hub home and remote-code modules cache inside ``tmp_path``."""
    for var in ("HF_HOME", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "hf_home" / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers
    import transformers.dynamic_module_utils as dmu

    # The cache path is read once at import: point the module's copy there too, and undo the
    # sys.path entry and the imported remote modules it leaves behind.
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_home" / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield transformers
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


def _random_model(cfg):
    """k3train's model with every float tensor drawn at random (the router bias too), so that a
    swapped, transposed or ignored tensor changes the logits."""
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
    return model


@pytest.mark.parametrize("extra", [
    # KKKM, layer 0 dense, layers 1-3 LatentMoE with a shared expert, AttnRes blocks of 2
    ["model.dense_layers=1"],
    # standard residual, a tied head, KDA and MLA interleaved, two shared experts, other SiTU betas
    ["model.attnres.enabled=false", "model.tie_embeddings=true", "model.layer_pattern=KM",
     "moe.num_shared_experts=2", "model.ffn.situ_beta=2.0", "model.ffn.situ_beta_lin=7.0"],
], ids=["attnres", "residual_tied"])
def test_auto_model_reproduces_k3train_logits(tmp_path, world1, transformers_home, extra):
    cfg = tiny_cfg("train.device=cpu", "model.vocab_size=300", *extra)
    model = _random_model(cfg)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf_remote", log=lambda *_: None)
    auto_config = transformers_home.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    assert (auto_config.model_type, auto_config.k3train["model"]) == ("k3train_k3", cfg.model.model_dump(mode="json"))
    hf, info = transformers_home.AutoModelForCausalLM.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "K3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    n_ours = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert sum(p.numel() for p in hf.parameters()) + sum(b.numel() for b in hf.buffers()) == n_ours
    tokens = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = model(tokens), hf.eval()(tokens).logits
    assert ref.abs().max() > 0.3  # logits of a size where 1e-5 means something
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # generate (no cache: each step reads the whole prefix) continues as k3train's greedy argmax
    seq = tokens[:1, :6]
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        generated = hf.generate(tokens[:1, :6], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, seq)


def test_auto_tokenizer_encodes_as_the_byte_tokenizer(tmp_path, world1, transformers_home):
    cfg = tiny_cfg("train.device=cpu")
    out = export_hf(build_model(cfg).state_dict(), cfg, tmp_path / "hf_byte", log=lambda *_: None)
    tok = transformers_home.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    ours = ByteTokenizer()
    ids = tok(TEXT)["input_ids"]
    assert ids == ours.encode(TEXT) and len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == ours.decode(ids) == TEXT
    assert tok.eos_token_id == ours.eod_id == 256
    assert tok.decode([*ids, 256], skip_special_tokens=True) == TEXT


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_auto_tokenizer_loads_an_exported_bpe(tmp_path, world1, transformers_home, kind):
    """A tokenizers BPE (copied) and the same BPE as a tiktoken file (converted to a
    tokenizer.json) encode the embedded corpus and odd text to k3train's ids."""
    docs = embedded_documents()[:40]
    spec = train_bpe(docs, 400, tmp_path / "bpe")
    if kind == "tiktoken":
        spec = write_tiktoken(spec, tmp_path / "bpe.tiktoken")
    ours = load_tokenizer(str(spec))
    assert ours.kind == kind
    cfg = tiny_cfg("train.device=cpu", f"data.tokenizer={spec}", f"model.vocab_size={ours.vocab_size}")
    out = export_hf(build_model(cfg).state_dict(), cfg, tmp_path / f"hf_{kind}", tokenizer=ours, log=lambda *_: None)
    tok = transformers_home.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    if kind == "hf":  # (the tiktoken file made from this BPE also ranks "<|endoftext|>" as the
        assert tok.eos_token_id == ours.eod_id  # ordinary token 0, which its special text resolves to)
    for text in [*docs, TEXT, "don't 12345 x\r\n\r\n  y  "]:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text), text[:40]
        assert tok.decode(ids) == ours.decode(ids) == text
    assert len(tok(docs[0])["input_ids"]) < 0.8 * len(docs[0].encode("utf-8"))  # merges applied


def test_kimi_linear_layout_refuses_naming_each_misfit(tmp_path, world1):
    cfg = tiny_cfg("train.device=cpu")
    state = build_model(cfg).state_dict()
    with pytest.raises(UsageError) as err:
        export_hf(state, cfg, tmp_path / "kl", layout="kimi_linear", log=lambda *_: None)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("export-hf --layout kimi_linear: this model does not fit")
    for part in ("Block AttnRes", "KDA forget gate", "MLA output gate", "LatentMoE", "SiTU-GLU"):
        assert part in msg, part
    assert not (tmp_path / "kl").exists()
    # A dense pure-KDA model without AttnRes is refused for what remains, and only that.
    cfg = tiny_cfg("train.device=cpu", "model.attnres.enabled=false", "model.layer_pattern=K", "model.dense_layers=4")
    with pytest.raises(UsageError) as err:
        export_hf(build_model(cfg).state_dict(), cfg, tmp_path / "kl", layout="kimi_linear")
    msg = str(err.value)
    assert "KDA forget gate" in msg and "SiTU-GLU" in msg
    assert not any(part in msg for part in ("AttnRes", "MLA", "LatentMoE", "tied"))
    with pytest.raises(UsageError, match="--layout 'kimi' is not a layout; allowed: k3train, kimi_linear"):
        export_hf(state, cfg, tmp_path / "kl", layout="kimi")


def test_kimi_linear_forget_gate_differs_from_k3trains(world1, transformers_home):
    """The refusal's gate misfit, against transformers' own module: loaded with our weights in
    its layout, KimiLinearForgetGate's log-decays are not k3train's (nor bounded by ours)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    cfg = tiny_cfg("train.device=cpu")
    kda = _random_model(cfg).layers[0].mixer
    H, K = kda.num_heads, kda.head_dim
    config = transformers_home.KimiLinearConfig(hidden_size=32, linear_attn_config={"num_heads": H, "head_dim": K})
    gate = KimiLinearForgetGate(config)
    with torch.no_grad():
        gate.f_a_proj.weight.copy_(kda.f_down.weight)
        gate.f_b_proj.weight.copy_(kda.f_up.weight)
        gate.dt_bias.copy_(kda.dt_bias.reshape(-1))
        gate.A_log.copy_(kda.A_log.view(1, 1, H, 1))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        f, dt_bias = kda.gate_inputs(x)
        ours = cfg.model.kda.gate_lower_bound * torch.sigmoid(kda.A_log.exp()[:, None] * (f + dt_bias))
        theirs = gate(x)
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max() > 1e-2
