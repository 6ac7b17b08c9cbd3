"""The package as a user gets it: `python -m build --wheel` makes a wheel of this checkout
(scikit-build-core driving the project's CMake build), a fresh virtual environment installs it
with `pip install "<wheel>[torch]"` (numpy and current torch, see below), and a script run there,
without the build tree on its path, imports it, makes a round trip with a real sb-planner and
runs the attention op.

Slow on purpose (it compiles the extension): CTest runs it alone. The fresh environment sees
the torch of the interpreter running this test (the project venv's current torch from PyPI)
through a .pth file, so pip resolves the `[torch]` extra against that installed torch instead of
downloading and unpacking about 5 GB again (about 100 s); SB_WHEEL_FRESH_TORCH=1 installs torch
from PyPI into the fresh environment as a user's first install does. Environment:
  SB_WHEEL_BUILD_DIR    CMake build directory of the wheel (kept between runs: rebuilds are quick)
  SB_SOURCE_DIR         the checkout to package (default: this file's)
  SB_WHEEL_FRESH_TORCH  1: torch from PyPI in the fresh environment, not the running one's
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

REPO = pathlib.Path(os.environ.get("SB_SOURCE_DIR") or
                    pathlib.Path(__file__).resolve().parents[2])


def run(command, **kwargs):
    """Runs `command`, failing the test with its output when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}:\n"
                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    build_dir = os.environ.get("SB_WHEEL_BUILD_DIR") or str(tmp_path_factory.mktemp("build"))
    command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out),
               f"-Cbuild-dir={build_dir}",
               # The CPU package: the CUDA kernels would add minutes and no GPU is here.
               "-Ccmake.define.SB_WITH_CUDA=OFF"]
    if shutil.which("ccache"):
        command += ["-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    start = time.monotonic()
    run(command + [str(REPO)])
    print(f"wheel built in {time.monotonic() - start:.0f} s")
    wheels = sorted(out.glob("sparsebalance-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    return wheels[0]


class FreshVenv:
    def __init__(self, python, wheel):
        self.python, self.wheel = python, wheel


def installed_torch_site():
    """The site directory that holds the running interpreter's torch, or None to install torch
    from PyPI (SB_WHEEL_FRESH_TORCH=1, or no torch here)."""
    if os.environ.get("SB_WHEEL_FRESH_TORCH") == "1":
        return None
    try:
        import torch
    except ImportError:
        return None
    return pathlib.Path(torch.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel):
    venv = tmp_path_factory.mktemp("venv")
    run(["/usr/bin/python3", "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    torch_site = installed_torch_site()
    if torch_site is not None:
        # After the fresh environment's own site-packages on sys.path: what pip installs there
        # (the wheel) comes first, and pip counts the torch found here as installed.
        purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        (pathlib.Path(purelib.stdout.strip()) / "sb_test_torch.pth").write_text(f"{torch_site}\n")
    start = time.monotonic()
    installed = run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                     f"{wheel}[torch]"])
    if torch_site is not None:
        # The extra was resolved against the torch already there, and the wheel installed.
        assert "Requirement already satisfied: torch" in installed.stdout, installed.stdout
        done = re.search(r"^Successfully installed (.*)$", installed.stdout, re.MULTILINE)
        assert done and re.search(r"\bsparsebalance-", done.group(1)), installed.stdout
        assert not re.search(r"\btorch-", done.group(1)), installed.stdout
    print(f"wheel {'(torch from ' + str(torch_site) + ') ' if torch_site else 'and torch '}"
          f"installed in {time.monotonic() - start:.0f} s")
    yield FreshVenv(python, wheel)
    shutil.rmtree(venv, ignore_errors=True)  # about 5 GB (torch): pytest keeps its tmp dirs


def test_the_wheel_holds_the_package_and_the_licence(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("sparsebalance/_C") and n.endswith(".so") for n in names), names
    for module in ("__init__.py", "_errors.py", "data.py", "ops.py"):
        assert f"sparsebalance/{module}" in names
    assert any(n.endswith("licenses/LICENSE") for n in names), names


def test_a_fresh_venv_imports_it_plans_with_a_real_planner_and_runs_the_op(fresh_venv, planner,
                                                                          tmp_path):
    version = fresh_venv.wheel.name.split("-")[1]
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, sys
        import torch
        import sparsebalance as sb
        from sparsebalance.ops import reference_attention, sparse_attention

        where = pathlib.Path(sb.__file__).resolve()
        assert pathlib.Path(sys.prefix).resolve() in where.parents, where
        assert sb.__version__ == "{version}", sb.__version__
        print("torch", torch.__version__, "sparsebalance", sb.__version__, "from", where.parent)

        admin = sb.connect("{planner.address}")
        job = admin.create_job("wheel", sb.PlannerConfig(ranks=2, micro_batches=2))
        client = sb.connect("{planner.address}", job_id=job.job_id, token=job.token)
        config, next_step, _ = client.join_job(0)
        assert (config.ranks, next_step) == (2, 0)
        client.join_job(1)
        batch = [sb.Sample(id=i, length=n) for i, n in enumerate([4096, 300, 2000, 9000, 77])]
        assert client.submit_batch(0, batch) == []
        planned = sorted(s.id for r in (0, 1) for mb in client.get_rank_plan(0, r).micro_batches
                         for s in mb.samples)
        assert planned == [0, 1, 2, 3, 4], planned

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(700, 2, 64, generator=g, requires_grad=True) for _ in range(3))
        out, recall = sparse_attention(q, k, v, [0, 300, 700], [1.0, 1.0])
        ref = reference_attention(q, k, v, [0, 300, 700])
        assert recall == 1.0 and torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
        out.sum().backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
        print("wheel check passed")
        """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = run([str(fresh_venv.python), str(script)], env=env, cwd=tmp_path)
    print(result.stdout)
    assert "wheel check passed" in result.stdout
