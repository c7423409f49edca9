"""The README's offline example, saved as a user's script and run as one: no `__main__` guard, ranks spawned.

multiprocessing's spawn would re-run the script in every rank; cpllm starts its
ranks as fresh interpreters, so the script works as written. The example runs
on the tiny model (the only change to the README's text) to keep the test short.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tiny_models import save_tiny_hf_model

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_offline_example() -> str:
    match = re.search(r"## Offline API.*?```python\n(.*?)```", README.read_text(), re.S)
    assert match, "the README has no offline API example"
    return match.group(1)


def test_readme_offline_example_runs_as_a_script(tmp_path):
    example = readme_offline_example()
    assert "prefill_context_parallel_size=2" in example and "__main__" not in example
    folder = save_tiny_hf_model(str(tmp_path / "tiny"), "llama", seed=0)
    script = tmp_path / "example.py"
    script.write_text(example.replace("model=None", f"model={folder!r}", 1).replace("512 << 20", "1 << 20", 1))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    last_line = done.stdout.strip().splitlines()[-1]
    assert last_line.endswith(("length", "stop")), done.stdout
