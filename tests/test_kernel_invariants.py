"""Source-level invariants of the CUDA kernels that the code relies on but no CPU run can observe.

The programmatic launch chain (docs/decisions.md): every kernel triggers its dependents only after its own grid
dependency wait (right after it, but for pre_dispatch: after its fenced ids), so a running grid implies that every
earlier kernel of the chain has completed. The GEMM producer's tile decode, L2 GEMV's ids and the combine's first ids
read outputs of kernels two or more launches back before their own wait, and rely on it; L1 GEMV reads its direct
predecessor's (pre_dispatch's) ids before its wait, relying on the late trigger.
"""
from __future__ import annotations

import pathlib
import re

import pytest

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
# fenced the token's ids, which the FP4 GEMV's L1 reads before its own wait (docs/decisions.md). Between its one wait
# and its trigger: the ids' store, then the fence, then the block barrier right before the trigger, and no return
# after the fence (an exited block counts as triggered, so a return past the fence would trigger unfenced blocks).
LATE_TRIGGER = {"sm90_pre_dispatch.cu": ("topk_idx_offset)[", "__threadfence();")}


def late_trigger_ok(name: str, lines: list, i: int) -> None:
    store, fence = LATE_TRIGGER[name]
    n = lines[i][0]
    waits = [j for j in range(i) if re.search(r"\bgrid_dependency_wait\(\)", lines[j][1])]
    assert len(waits) == 1, f"{name}:{n}: one dependency wait before the trigger"
    between = [t for _, t in lines[waits[0] + 1:i]]
    stores = [j for j, t in enumerate(between) if store in t and "=" in t]
    fences = [j for j, t in enumerate(between) if t.endswith(fence)]  # maybe guarded: `if (writer) __threadfence();`
    assert stores and fences and stores[-1] < fences[0], f"{name}:{n}: the ids are stored, then fenced"
    assert between[-1] == "__syncthreads();", f"{name}:{n}: a block barrier right before the late trigger"
    assert not any(re.search(r"\breturn\b", t) for t in between[fences[0]:]), f"{name}:{n}: a return after the fence"
    assert not any(re.search(r"\blaunch_dependents\(\)", t) for t in between), f"{name}:{n}: an earlier trigger"


def test_every_trigger_follows_a_dependency_wait():
    triggers = 0
    for path in sorted(KERNELS.glob("*.cu*")):
        lines = code_lines(path)
        for i, (n, text) in enumerate(lines):
            if re.search(r"\blaunch_dependents\(\)", text):
                triggers += 1
                if path.name in LATE_TRIGGER:
                    late_trigger_ok(path.name, lines, i)
                    continue
                assert i > 0 and re.search(r"\bgrid_dependency_wait\(\)", lines[i - 1][1]), (
                    f"{path.name}:{n}: launch_dependents() must directly follow grid_dependency_wait() "
                    "(docs/decisions.md, programmatic launch chain)")
    # pre_dispatch; routing, gather, combine (sm90_routing.cu); FP8 GEMM (2); FP4 GEMM (2) and its requantization, fold
    # passes (3, sm90_fp4_grouped_gemm.cu); the GEMVs (2)
    assert triggers >= 13


def test_the_late_trigger_check_rejects_reorderings(tmp_path):
    """late_trigger_ok on edited copies of pre_dispatch: the fence moved above the ids' store, a return after the
    fence, the barrier dropped, and the trigger moved above the store each fail it."""
    name = "sm90_pre_dispatch.cu"
    src = (KERNELS / name).read_text().split("\n")
    code = [line.split("//", 1)[0].strip() for line in src]
    store = next(i for i, t in enumerate(code) if LATE_TRIGGER[name][0] in t and "=" in t)
    fence = next(i for i, t in enumerate(code) if t.endswith(LATE_TRIGGER[name][1]))
    trigger = code.index("ptx::launch_dependents();")
    assert store < fence < trigger and code[trigger - 1] == "__syncthreads();"

    def edited(remove=None, insert=None):
        """The source without line `remove`, with `insert` = (line, text) put before that original line."""
        out = [(i, line) for i, line in enumerate(src) if i != remove]
        if insert is not None:
            at = next(k for k, (i, _) in enumerate(out) if i >= insert[0])
            out.insert(at, (-1, insert[1]))
        return [line for _, line in out]

    edits = {
        "fence-first": edited(fence, (store, "__threadfence();")),
        "return": edited(insert=(fence + 1, "if (top_k < 0) return;")),
        "no-barrier": edited(trigger - 1),
        "trigger-first": edited(trigger, (store, "ptx::launch_dependents();")),
    }
    lines = code_lines(KERNELS / name)
    late_trigger_ok(name, lines, next(i for i, (_, t) in enumerate(lines) if "launch_dependents()" in t))
    for label, text in edits.items():
        path = tmp_path / name
        path.write_text("\n".join(text))
        lines = code_lines(path)
        first = next(i for i, (_, t) in enumerate(lines) if "launch_dependents()" in t)
        with pytest.raises(AssertionError):
            late_trigger_ok(name, lines, first)


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
