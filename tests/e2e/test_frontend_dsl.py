"""SGLang's frontend DSL from the project's Python, as a user runs it: a separate program,
started with the environment's interpreter and no extra environment, that imports ``sglang``
and runs ``gen``, ``select``, ``fork`` and ``run_batch`` against a Spexis server.

On the CPU machine ``import sglang`` needs the CPU support (no triton in the CPU build of
torch); ``scripts/setup_cpu_env.sh`` installs ``spexis_sglang_cpu.pth``, which applies it at
the first ``import sglang`` (``spexis_sglang/cpu_import_hook.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from spexis_sglang.cpu_import_hook import PTH_NAME
from spexis_sglang.cpu_support import cuda_available

from .test_sp_lossless import sp_args, trained_head  # noqa: F401

pytestmark = pytest.mark.e2e

PROGRAM = textwrap.dedent("""
    import json, sys

    import sglang as sgl


    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.user(("Say it in one word.", "Say it in a sentence.")[i])
            f += sgl.assistant(sgl.gen("again", max_tokens=8, temperature=0))
        s += sgl.user("Is that answer correct? Answer yes or no.")
        s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))
        return [f["again"] for f in forks]


    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
    questions = ["What is the capital of France?", "What is 2 + 2?"]
    states = qa.run_batch([{"question": q} for q in questions])
    print(json.dumps([
        {"answer": st["answer"], "verdict": st["verdict"], "forks": st.ret_value}
        for st in states
    ]))
    """)


def test_frontend_program_runs_from_the_venv_python(
    server_factory, trained_head, user_env, tmp_path
):
    if not cuda_available():
        pth = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
        assert os.path.isfile(
            pth
        ), f"{pth} is missing: run `make venv` (scripts/setup_cpu_env.sh) to install it"
    server = server_factory(sp_args(2, trained_head))
    script = tmp_path / "dsl_program.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [sys.executable, str(script), server.base_url],
        cwd=str(tmp_path),  # outside the repository, as a user's own program
        env=user_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print("DSL program:", results)
    assert len(results) == 2
    for r in results:
        assert r["answer"].strip()
        assert r["verdict"] in ("yes", "no")
        assert len(r["forks"]) == 2 and all(isinstance(x, str) for x in r["forks"])
