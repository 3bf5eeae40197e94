"""Where the eager time goes: .module() vs the graph module, unrewritten vs rewritten (gpt2_attn_proj)."""
import statistics, sys, time, collections, torch
sys.path.insert(0, "benchmarks")
import nvgemm_blocks as nb
from branchyard.lowering.nvgemm.fuse import nvgemm
from branchyard.lowering.nvgemm.program_race import program_inputs
import branchyard.lowering.nvgemm.op as op_mod

m = int(sys.argv[1]) if len(sys.argv) > 1 else 64
print("torch", torch.__version__, "M", m, flush=True)
spec = nb.blocks()["gpt2_attn_proj"]
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
blk = spec.make().to(dev).to(torch.bfloat16).eval()
args = tuple(torch.randn(m, spec.d, device=dev, dtype=torch.bfloat16) for _ in range(2))
hits = collections.Counter()
orig = op_mod._bypass_plan
def counting(*a):
    p = orig(*a)
    hits["bypass" if p is not None else "dispatcher"] += 1
    return p
with torch.no_grad():
    ep = torch.export.export(blk, args)
    rw = nvgemm(ep)
    print("fused", nb.fused_ops(rw, ep), flush=True)
    um, rm = ep.module(), rw.module()
    ui, ri = program_inputs(ep), program_inputs(rw)
    print(rm.code)
    fns = {"blk": lambda: blk(*args), "unrw_mod": lambda: um(*args), "rw_mod": lambda: rm(*args),
           "unrw_gm": lambda: ep.graph_module(*ui), "rw_gm": lambda: rw.graph_module(*ri)}
    for f in fns.values():
        for _ in range(50): f()
    op_mod._bypass_plan = counting
    for name in ("rw_mod", "rw_gm"):
        hits.clear(); fns[name](); print(name, dict(hits))
    op_mod._bypass_plan = orig
    names = list(fns); samples = {k: [] for k in names}
    for r in range(15):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            sync(); t = time.perf_counter()
            for _ in range(200): fns[k]()
            sync(); samples[k].append((time.perf_counter() - t) / 200 * 1e6)
    for k in names: print(f"{k:9s} {statistics.median(samples[k]):7.1f} us")
    for a, b in (("rw_mod", "unrw_mod"), ("rw_gm", "unrw_gm")):
        print(f"{a}/{b}: {statistics.median(x / y for x, y in zip(samples[a], samples[b])):.3f}")
