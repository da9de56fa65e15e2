"""Every kernel set the CPU can run, checked: a test process runs the widest one; a child process
re-runs a test file's product tests with `SHOAL_KERNEL_ISA` capping the kernels at a narrower set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NARROWER = {
    "avx512vbmi": ("avx512", "avx2", "portable"),
    "avx512": ("avx2", "portable"),
    "avx2": ("portable",),
    "portable": (),
}
"""The instruction sets below each one: the CPU has them too, and SHOAL_KERNEL_ISA selects them."""
CAPS = ("avx512", "avx2", "portable", "int8")
"""What a test is parametrized over (each skipped where the CPU's widest kernels are that set);
"int8": the widest kernels with int8 activations (SHOAL_KERNEL_ACTS=int8, AVX-512 VNNI only)."""


def capped_env(active: str, isa: str) -> dict[str, str]:
    """The environment of a child whose kernels are capped at `isa` (or, for "int8", round their
    activations to int8); skips the test when `isa` is not below `active` (the widest set, which
    the test process itself ran) or, for "int8", when `active` has no int8 bodies."""
    if isa == "int8":
        if not active.startswith("avx512"):
            pytest.skip(f"the CPU's widest kernels are {active}: no int8 activations")
        return {**os.environ, "SHOAL_KERNEL_ACTS": "int8"}
    if isa not in NARROWER.get(active, ()):
        pytest.skip(f"the CPU's widest kernels are {active}: this process tested them")
    return {**os.environ, "SHOAL_KERNEL_ISA": isa}


def run_capped(test_file: str, env: dict[str, str], tests: str) -> None:
    """Run `test_file`'s tests matching `tests` (a `-k` expression) in a child with `env`."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]
