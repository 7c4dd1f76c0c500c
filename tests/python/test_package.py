"""The package as a user gets it: a fresh virtual environment, `pip wheel` + `pip install` of
bindings/python (scikit-build-core builds libferry with the project's CMake), then the
safetensors-parity suite (test_parity.py) against the installed package, with no environment
variable pointing at a library. The wheel carries one libferry.so, the `ferry` command (a
console script, and python -m tensorferry) and a platform tag.

This builds the C++ library once more (a few minutes on two cores). Developers iterating on
Python may skip it with TENSORFERRY_SKIP_PIP_TEST=1; CI runs it (tests/run_all.sh)."""

import os
import platform
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def run(cmd, env, cwd, timeout=1800):
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, "%s failed (%d):\n%s\n%s" % (
        " ".join(cmd), done.returncode, done.stdout[-6000:], done.stderr[-6000:])
    return done.stdout


@pytest.mark.skipif(os.environ.get("TENSORFERRY_SKIP_PIP_TEST") == "1",
                    reason="TENSORFERRY_SKIP_PIP_TEST=1")
def test_pip_install_into_a_fresh_venv_then_safetensors_parity(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TENSORFERRY_LIBRARY", "FERRY_BUILD_DIR", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], env, str(tmp_path))
    py = str(venv / "bin" / "python")

    wheels = tmp_path / "wheels"
    run([py, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
         os.path.join(ROOT, "bindings", "python")], env, str(tmp_path))
    [wheel] = os.listdir(wheels)
    # A platform wheel: the library inside is machine code (not py3-none-any).
    assert wheel.endswith("-py3-none-linux_%s.whl" % platform.machine()), wheel
    with zipfile.ZipFile(wheels / wheel) as z:
        libs = [n for n in z.namelist() if "libferry" in n]
        assert "tensorferry/bin/ferry" in z.namelist()
    assert libs == ["tensorferry/libferry.so"], libs

    run([py, "-m", "pip", "install", "-q", str(wheels / wheel), "numpy", "ml_dtypes", "pytest",
         "safetensors"], env, str(tmp_path))
    # auditwheel names the manylinux policy the library meets (glibc symbol versions); it
    # refuses a wheel that no policy allows.
    run([py, "-m", "pip", "install", "-q", "auditwheel"], env, str(tmp_path))
    shown = run([py, "-m", "auditwheel", "show", str(wheels / wheel)], env, str(tmp_path))
    assert "manylinux_" in shown, shown

    # The command line comes with the wheel: the `ferry` console script and python -m.
    fixture = os.path.join(ROOT, "tests", "data", "safetensors", "all_dtypes.safetensors")
    assert run([str(venv / "bin" / "ferry"), "--version"], env, str(tmp_path)).startswith(
        "ferry 0.")
    shown = run([py, "-m", "tensorferry", "inspect", fixture], env, str(tmp_path))
    assert "tensors    22" in shown, shown
    run([str(venv / "bin" / "ferry"), "convert", fixture, str(tmp_path / "c.ferry")], env,
        str(tmp_path))
    missing = subprocess.run([str(venv / "bin" / "ferry"), "verify", str(tmp_path / "nope")],
                             env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "NotFound" in missing.stderr, missing

    env["TENSORFERRY_EXPECT_INSTALLED"] = "1"
    out = run([py, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
               os.path.join(ROOT, "tests", "python", "test_parity.py")], env, str(tmp_path))
    assert " passed" in out and "failed" not in out, out


def test_python_m_tensorferry_runs_the_command(tmp_path):
    # In a checkout (no wheel): FERRY_BIN names the built command; python -m becomes it.
    from test_safetensors_interop import FERRY

    if FERRY is None:
        pytest.skip("no built `ferry` (set FERRY_BIN)")
    env = dict(os.environ, FERRY_BIN=FERRY,
               PYTHONPATH=os.path.join(ROOT, "bindings", "python"))
    done = subprocess.run([sys.executable, "-m", "tensorferry", "verify",
                           str(tmp_path / "nope.ferry")], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 1 and "nope.ferry" in done.stderr, done
    assert subprocess.run([sys.executable, "-m", "tensorferry", "--version"], env=env,
                          capture_output=True, text=True).stdout.startswith("ferry 0.")
    env.pop("FERRY_BIN")
    done = subprocess.run([sys.executable, "-m", "tensorferry", "--version"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "has no `ferry` command" in done.stderr, done
