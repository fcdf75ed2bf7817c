# What produced layers_*.log (kept with the results, not a project script): per-layer mixer/FFN
# outputs of CachedModel against the full forward, fp32 on CUDA, fixed autotune.
#   python layers_diag.py configs/k3_mini.yaml cuda [ahead]
import sys, torch, time
from k3train.config import load_config
from k3train.distributed import init_distributed
from k3train.infer.cache import CachedModel
from k3train.kernels import apply as apply_kernels
from k3train.model.model import build_model
from k3train.ops.triton_compile import compile_ahead
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
cfg = load_config(sys.argv[1], ["parallel.tp=1","parallel.pp=1","parallel.ep=1","moe.dispatcher=local",f"train.device={dev}","kernels.compile=false"])
apply_kernels(cfg); init_distributed()
torch.manual_seed(0); model = build_model(cfg).to(dev).eval()
ids = torch.randint(0, 256, (1, 80)).to(dev)
def rel(a, b): return ((a.float()-b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
rec = {}
mode = {"tag": None}
def hook(name):
    def f(mod, inp, out):
        if mode["tag"] is None: return
        out = out[0] if isinstance(out, tuple) else out
        rec.setdefault(mode["tag"], {})[name] = (inp[0].detach().float().clone(), out.detach().float().clone())
    return f
def hook_all():
    for i, layer in enumerate(model.layers):
        layer.mixer.register_forward_hook(hook(f"L{i}.mixer"))
        layer.ffn.register_forward_hook(hook(f"L{i}.ffn"))
hook_all()
def report(tag, ref="full"):
    bad = []
    for name, (i_, o_) in rec[tag].items():
        ri, ro = rec[ref][name]
        if i_.shape != ri.shape: continue
        bad.append((name, rel(i_, ri), rel(o_, ro)))
    print(tag, "first entries (name, in rel, out rel):", [f"{n} {a:.1e} {b:.1e}" for n, a, b in bad[:10]])
    worst = [x for x in bad if x[2] > 1e-3][:4]; print("  first out>1e-3:", worst)
t0 = time.time()
if "ahead" in sys.argv:
    compile_ahead(lambda: model(ids[:, :8]), label="full forward")
with torch.no_grad():
    mode["tag"] = "full"; full = model(ids).float(); print("full done", time.time()-t0)
    mode["tag"] = "full2"; full2 = model(ids).float(); print("full twice", rel(full2, full))
    cached = CachedModel(model); hook_all()
    mode["tag"] = "prefill"; cached.reset(); p = cached(ids).float(); print("prefill-all logits rel", rel(p, full)); report("prefill")
    mode["tag"] = None
    cached.reset(); out = [cached(ids[:, :64]).float()]
    for t in range(64, 80): out.append(cached(ids[:, t:t+1]).float())
    print("stepwise logits rel (steps only)", rel(torch.cat(out, 1)[:, 64:], full[:, 64:]))
