"""Source-level invariants of the CUDA kernels that the code relies on but no CPU run can observe.

The programmatic launch chain (docs/decisions.md): every kernel triggers its dependents only after its own grid
dependency wait (right after it, but for pre_dispatch: after its fenced ids), so a running grid implies that every
earlier kernel of the chain has completed. The GEMM producer's tile decode, the GEMVs' ids and the combine's first ids
read outputs of kernels two or more launches back before their own wait, and rely on it.
"""
from __future__ import annotations

import pathlib
import re

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "kernels"


def code_lines(path: pathlib.Path) -> list:
    """The file's lines with // comments removed and blank lines dropped, as (line number, text)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("//", 1)[0].strip()
        if text:
            out.append((n, text))
    return out


def function_body(text: str, open_brace: int) -> str:
    """The text between the brace at `open_brace` and its match (braces in comments and strings are rare enough in
    these files: none unbalanced)."""
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i]
    raise AssertionError("unbalanced braces")


# The one kernel whose trigger comes later than right after its wait: pre_dispatch triggers once its blocks stored and
# fenced the token's ids, which the FP4 GEMV's L1 reads before its own wait (docs/decisions.md). The lines from its
# wait to its trigger: no return past the ids (a block that returns counts as triggered) and no second wait.
LATE_TRIGGER = {"sm90_pre_dispatch.cu": "__threadfence();"}


def test_every_trigger_follows_a_dependency_wait():
    triggers = 0
    for path in sorted(KERNELS.glob("*.cu*")):
        lines = code_lines(path)
        for i, (n, text) in enumerate(lines):
            if re.search(r"\blaunch_dependents\(\)", text):
                triggers += 1
                if path.name in LATE_TRIGGER:
                    waits = [j for j in range(i) if re.search(r"\bgrid_dependency_wait\(\)", lines[j][1])]
                    assert len(waits) == 1, f"{path.name}:{n}: one dependency wait before the trigger"
                    between = [t for _, t in lines[waits[0] + 1:i]]
                    assert LATE_TRIGGER[path.name] in between and between[-1] == "__syncthreads();", (
                        f"{path.name}:{n}: the late trigger follows the fenced stores and a block barrier")
                    assert not any(re.search(r"\blaunch_dependents\(\)", t) for t in between)
                    continue
                assert i > 0 and re.search(r"\bgrid_dependency_wait\(\)", lines[i - 1][1]), (
                    f"{path.name}:{n}: launch_dependents() must directly follow grid_dependency_wait() "
                    "(docs/decisions.md, programmatic launch chain)")
    assert triggers >= 9  # pre_dispatch, routing, gather, combine, FP8 GEMM (2), FP4 GEMM (2), NVFP4 requant, GEMVs


def test_every_pdl_kernel_has_a_dependency_wait():
    """Each kernel launched with launch_pdl has a grid dependency wait in its body."""
    launched = set()
    sources = {p: p.read_text() for p in sorted(KERNELS.glob("*.cu*"))}
    for text in sources.values():
        launched |= set(re.findall(r"launch_pdl\(\s*([A-Za-z_]\w*)\s*[<,]", text))
        # the GEMM launchers pass a local alias: `constexpr auto kernel = <kernel template><...>;`
        launched |= set(re.findall(r"auto kernel\s*=\s*([A-Za-z_]\w*)\s*<", text))
    launched.discard("kernel")
    assert {"pre_dispatch_kernel", "routing_kernel", "gather_kernel", "combine_kernel",
            "sm90_fp8_grouped_gemm_kernel", "nvfp4_requant_kernel"} <= launched, launched
    for name in sorted(launched):
        body = None
        for text in sources.values():
            m = re.search(r"\b" + name + r"\s*\([^;{]*\)\s*\{", text)
            if m:
                body = function_body(text, m.end() - 1)
                break
        assert body is not None, f"kernel {name} (launched with launch_pdl) not found"
        assert "grid_dependency_wait()" in body, f"kernel {name} never waits for its predecessor"
