"""Random matmul + elementwise programs through ``nvgemm(ep)`` on CPU.

Each program is a matmul root (``linear`` with or without bias, ``mm`` of
either weight layout, ``addmm``, a 3-D ``matmul``) followed by a random run of
steps: rows of the epilogue table in every spelling the matcher must read
(``b + y``, ``3.0 * y``, ``y / 4``, ``y * b``, casts), and steps it must stop
at (``y - b``, ``-y``, ``y * y``, ``cos``, a per-row vector, a flattening
view, a second user of the matmul). Exported statically and with a dynamic
leading dim, rewritten, and called against the program as exported, also at
a size other than the example's. On CPU the fused op runs
its reference path (fp32 epilogue, one rounding: ``docs/nvgemm.md``), so
programs computed in bfloat16 or float16 are compared at their own precision.
"""

from __future__ import annotations

import logging
import random
import warnings

import torch
from torch.export import Dim, export

import branchyard.lowering.nvgemm as nvgemm

F = torch.nn.functional

#: step name -> (y, module, residual r, per-row vector c) -> new y. The first
#: group is what the epilogue table fuses; the second ends a chain before it.
#: A cast to the value's own dtype is no step at all.
CASTS = ("to_float32", "to_bfloat16")
FUSED_STEPS = {
    "bias": lambda y, m, r, c: y + m.b,
    "bias_left": lambda y, m, r, c: m.b + y,
    "bias_2d": lambda y, m, r, c: y + m.b.reshape(1, -1),
    "scale": lambda y, m, r, c: y * 0.5,
    "scale_left": lambda y, m, r, c: 3.0 * y,
    "divide": lambda y, m, r, c: y / 4.0,
    "scale_col": lambda y, m, r, c: y * m.b,
    "residual": lambda y, m, r, c: y + r,
    "residual_left": lambda y, m, r, c: r + y,
    "relu": lambda y, m, r, c: torch.relu(y),
    "gelu_erf": lambda y, m, r, c: F.gelu(y),
    "gelu_tanh": lambda y, m, r, c: F.gelu(y, approximate="tanh"),
    "silu": lambda y, m, r, c: F.silu(y),
    "sigmoid": lambda y, m, r, c: torch.sigmoid(y),
    "tanh": lambda y, m, r, c: torch.tanh(y),
    "to_float32": lambda y, m, r, c: y.float(),
    "to_bfloat16": lambda y, m, r, c: y.to(torch.bfloat16),  # narrowing from fp32: fused, ends the chain
}
STOP_STEPS = {
    "subtract": lambda y, m, r, c: y - m.b,
    "negate": lambda y, m, r, c: -y,
    "square": lambda y, m, r, c: y * y,
    "cosine": lambda y, m, r, c: torch.cos(y),
    "add_scalar": lambda y, m, r, c: y + 1.5,
    "row_vector": lambda y, m, r, c: y + c,
    "flatten": lambda y, m, r, c: y.reshape(-1),
}
STEPS = {**FUSED_STEPS, **STOP_STEPS}
ROOTS = ("linear", "linear_no_bias", "mm_kn", "mm_nk", "addmm", "matmul")
PROGRAMS = 120


class Program(torch.nn.Module):
    def __init__(self, root: str, steps: list[str], k: int, n: int, dtype: torch.dtype, second_user: bool):
        super().__init__()
        self.root, self.steps, self.second_user = root, steps, second_user
        self.w = torch.nn.Parameter(torch.randn(n, k, dtype=dtype))
        self.w_kn = torch.nn.Parameter(torch.randn(k, n, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(n, dtype=dtype))

    def forward(self, x, r, c):
        k, n = self.w_kn.shape
        flat = x.reshape(-1, k)
        y = {
            "linear": lambda: F.linear(x, self.w, self.b),
            "linear_no_bias": lambda: F.linear(x, self.w),
            "mm_kn": lambda: (flat @ self.w_kn).reshape(*x.shape[:-1], n),
            "mm_nk": lambda: (flat @ self.w.t()).reshape(*x.shape[:-1], n),
            "addmm": lambda: torch.addmm(self.b, flat, self.w_kn).reshape(*x.shape[:-1], n),
            "matmul": lambda: torch.matmul(x, self.w_kn),
        }[self.root]()
        matmul_out = y
        for step in self.steps:
            y = STEPS[step](y, self, r.to(y.dtype), c.to(y.dtype))
        return (y, matmul_out) if self.second_user else y


def random_program(seed: int):
    rng = random.Random(seed)
    k, n = rng.choice([8, 16, 24]), rng.choice([8, 16, 32])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    steps = [rng.choice(list(STEPS)) for _ in range(rng.randint(1, 4))]
    model = Program(rng.choice(ROOTS), steps, k, n, dtype, second_user=rng.random() < 0.15)
    lead = (2, 3) if rng.random() < 0.3 else (4,)
    args = (torch.randn(*lead, k, dtype=dtype), torch.randn(*lead, n, dtype=dtype),
            torch.randn(*lead, 1, dtype=dtype))
    return model, args, dtype, seed % 3 == 0


def _close(got, want, dtype: torch.dtype) -> bool:
    if isinstance(want, (tuple, list)):
        return all(_close(g, w, dtype) for g, w in zip(got, want, strict=True))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return (got.shape == want.shape and got.dtype == want.dtype
            and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * (1 + want.float().abs().max().item())))


def _fused_ops(program) -> int:
    return sum(n.target is torch.ops.branchyard.fused_gemm_epilogue.default for n in program.graph.nodes)


def test_random_matmul_chains_keep_their_values_and_fuse_what_the_table_covers():
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # programs that do not export log torch's own error first
    try:
        counts = {"programs": 0, "exported": 0, "dynamic": 0, "fused": 0, "must_fuse": 0}
        for seed in range(PROGRAMS):
            model, args, dtype, dynamic = random_program(seed)
            counts["programs"] += 1
            try:
                if dynamic:
                    rows = Dim("rows", min=2, max=64)
                    program = export(model, args, dynamic_shapes=tuple({a.dim() - 2: rows} for a in args))
                else:
                    program = export(model, args)
            except Exception:  # a random program can be invalid (a shape that does not broadcast)
                continue
            counts["exported"] += 1
            rewritten = nvgemm.nvgemm(program)
            where = f"seed {seed}: {model.root} -> {model.steps} ({dtype}, second user {model.second_user})"
            assert _close(rewritten.module()(*args), program.module()(*args), dtype), where
            if dynamic:
                counts["dynamic"] += 1
                grown = tuple(torch.cat([a, 0.5 * a[..., :1, :]], dim=-2) for a in args)
                assert _close(rewritten.module()(*grown), program.module()(*grown), dtype), f"{where}, grown"
            fused = _fused_ops(rewritten)
            counts["fused"] += fused > 0
            first = model.steps[0]
            # A first step the table fuses, on a matmul with no second user, is always fused
            # (a bias right after an addmm/linear bias is a second bias step, still fused).
            if first in FUSED_STEPS and first not in CASTS and not model.second_user:
                counts["must_fuse"] += 1
                assert fused == 1, f"{where}: {fused} fused ops\n{rewritten.graph_module.code}"
            if first in STOP_STEPS and model.root in ("linear_no_bias", "mm_kn", "mm_nk", "matmul"):
                assert fused == 0, f"{where}: a chain that starts with a stop step was fused"
    finally:
        logging.disable(logging.NOTSET)
    print("random chain counts:", counts)
    assert counts["exported"] >= PROGRAMS * 0.7, counts
    assert counts["dynamic"] >= 25 and counts["must_fuse"] >= 40, counts
