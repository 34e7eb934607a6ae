"""A LlamaIndex user's script, as users write it: LlamaIndex imported first, in a fresh process,
and an ``InferScaleLLM`` given no ``user_id`` next to a retriever that has one.

That script used to answer "Empty Response": the LLM ran as user "default", refused the
retriever's handles of "jonas" as forged, and LlamaIndex's response synthesizer swallowed the
error (it catches ValueError). Import order turned out to play no part: the same script with
InferScale imported first failed the same way, which the second case checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")
pytestmark = pytest.mark.slow

SCRIPT = """
{imports}
eng = InferScaleEngine(model="smollm2", device="cpu", store_path={store!r})
for t in ["Jonas keeps bees on the roof of his building.", "Jonas's favourite dish is pierogi.",
          "Jonas moved to Gdansk in 2021.", "Jonas is allergic to cats."]:
    eng.memory.add(t, user_id="jonas")
qe = RetrieverQueryEngine.from_args(InferScaleRetriever(engine=eng, user_id="jonas", similarity_top_k=2),
                                    llm=InferScaleLLM(engine=eng, max_tokens=16, temperature=0))
print("ANSWER:", qe.query("Which city did Jonas move to?"))
# A prompt with handles no retriever issued, and no user_id: a clear error, not "Empty Response".
from inferscale_engine.errors import MissingUserError
(fact,) = eng.memory.add("Jonas plays chess.", user_id="jonas")
try:
    InferScaleLLM(engine=eng, max_tokens=2).complete("Memory: " + fact.handle)
except MissingUserError as exc:
    print("REFUSED:", exc)
eng.close()
"""

LLAMAINDEX_FIRST = """
from llama_index.core.query_engine import RetrieverQueryEngine
from inferscale_engine import InferScaleEngine
from inferscale_integrations.llamaindex import InferScaleLLM, InferScaleRetriever
"""

INFERSCALE_FIRST = """
from inferscale_engine import InferScaleEngine
from inferscale_integrations.llamaindex import InferScaleLLM, InferScaleRetriever
from llama_index.core.query_engine import RetrieverQueryEngine
"""


@pytest.mark.parametrize("imports", [LLAMAINDEX_FIRST, INFERSCALE_FIRST], ids=["llamaindex-first", "inferscale-first"])
def test_user_script_answers_from_memory(imports, smollm2_path, tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(imports=imports.strip(), store=str(tmp_path / "store"))))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    answer = next(line for line in r.stdout.splitlines() if line.startswith("ANSWER:"))
    assert "Gdansk" in answer, out[-6000:]
    assert "vLLM step failed" not in out and "Traceback" not in out, out[-6000:]
    assert "REFUSED: InferScaleLLM has no user_id" in r.stdout, out[-6000:]
