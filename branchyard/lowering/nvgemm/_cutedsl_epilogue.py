"""The epilogue's trace-time code shared by the CuTeDSL kernels: the steps
of :mod:`.kernel_math` applied to an accumulator fragment in registers.

Kept apart from the kernels so that neither kernel module imports the other.
Called while a kernel is traced (so CuTeDSL is imported inside the functions).
"""


# Accumulator elements the epilogue formulas handle per vector (see apply_steps).
_CHUNK = 8


def apply_steps(steps, tma_mat, acc, coords, local, sR, operands, m_last, n_last, products=None) -> None:
    """Trace-time unrolled: gather operands by (row, col), run the formulas in fp32, in place on ``acc``.

    ``coords[i]`` is the global (row, col) of ``acc[i]``, ``local[i]`` its
    (row, col) in the tile (the index into ``sR``, the residual tile of
    operand ``tma_mat`` in shared memory, when there is one). The fragment is
    processed ``_CHUNK`` elements at a time so that the gathered operands and
    temporaries stay a few registers next to the accumulators (whole-fragment
    vectors spilled to local memory). Rows/cols past the edge are clamped to
    the last one: the loads stay in bounds without a branch, and the TMA store
    drops those elements. Formulas come from ``kernel_formula`` (the shared
    table's, or its cheaper form where one is listed). A ``weight`` step reads
    its operand from ``products[step.index]``, the fp32 values of ``a @ W^T``
    at ``acc``'s positions (the small-M kernel's second accumulator).
    """
    import cutlass
    import cutlass.cute as cute

    from branchyard.lowering.nvgemm.kernel_math import CuteMath, kernel_formula

    m = CuteMath()
    total = cute.size(acc)
    chunk = next(c for c in (_CHUNK, 4, 1) if total % c == 0)
    formulas = [kernel_formula(step) for step in steps]

    def gathered(value):
        """The fp32 register vector of ``value(j)`` for ``j < chunk``."""
        vec = cute.make_rmem_tensor((chunk,), cutlass.Float32)
        for j in range(chunk):
            vec[j] = value(j)
        return vec

    def from_global(src, kind, start, j):
        """Operand ``src``'s element at ``acc[start + j]``'s (row, col), clamped in bounds."""
        row, col = coords[start + j]
        col = cutlass.min(col, n_last)
        value = src[col] if kind == "col" else src[cutlass.min(row, m_last), col]
        return value.to(cutlass.Float32)

    for start in range(0, total, chunk):
        vals = gathered(lambda j: acc[start + j])
        x = vals.load()
        for step, fn in zip(steps, formulas):
            if step.operand in ("none", "dtype"):
                x = fn(x, m)
            elif step.operand == "scalar":
                x = fn(x, step.value, m)
            elif step.operand == "weight":
                x = fn(x, gathered(lambda j: products[step.index][start + j]).load(), m)
            elif step.operand == "matrix" and step.index == tma_mat:
                x = fn(x, gathered(lambda j: sR[local[start + j]].to(cutlass.Float32)).load(), m)
            else:
                x = fn(x, gathered(lambda j: from_global(operands[step.index], step.operand, start, j)).load(),
                       m)
        vals.store(x)
        for j in range(chunk):
            acc[start + j] = vals[j]


def apply_tail(steps, x, residual):
    """Steps from the residual on, over one fp32 vector ``x``: the first step adds
    ``residual`` (the matching fp32 values), the rest take no tensor operand."""
    from branchyard.lowering.nvgemm.kernel_math import CuteMath, kernel_formula

    m = CuteMath()
    for i, step in enumerate(steps):
        fn = kernel_formula(step)
        if i == 0:
            x = fn(x, residual, m)
        elif step.operand == "scalar":
            x = fn(x, step.value, m)
        else:
            x = fn(x, m)
    return x
