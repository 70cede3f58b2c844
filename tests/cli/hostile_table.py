"""The hostile-input trials of tests/cli/hostile_inputs.yaml: run one through the entry point its tool's command
line uses before anything starts, and write the table of outcomes (docs/HOSTILE_INPUTS.md).

Each trial is ``{args, tool, exit, message}``: ``args`` a command line as a shell splits it (``{tmp}`` stands for a
scratch directory holding the files of :func:`make_files`), ``tool`` one of :data:`TOOLS` (default iso-train),
``exit`` the expected code (0 accepted, 2 one line naming the problem), ``message`` a substring of that line.
iso-train trials run ``megatron_iso.cli.train.validate`` (compose, schema, typed settings, this machine's checks:
what iso-train runs before any rank starts), iso-bench its ``_prepare``, iso-contract and iso-bisect their ``main``:
in process, no model built.

Regenerate the table after changing the trials or an error text::

    PYTHONPATH=. python -m tests.cli.hostile_table            # writes docs/HOSTILE_INPUTS.md
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TRIALS = HERE / "hostile_inputs.yaml"
DOC = HERE.parents[1] / "docs" / "HOSTILE_INPUTS.md"


def _iso_train(args: list[str]) -> int:
    from megatron_iso.cli.exit_codes import run_cli
    from megatron_iso.cli.train import PROG, validate

    return run_cli(PROG, lambda: (validate(args), 0)[1])


def _iso_bench(args: list[str]) -> int:
    from megatron_iso.cli.bench import PROG, _prepare
    from megatron_iso.cli.exit_codes import run_cli

    return run_cli(PROG, lambda: _prepare(args, []))


def _iso_contract(args: list[str]) -> int:
    from megatron_iso.cli.contract import main

    return main(args)


def _iso_bisect(args: list[str]) -> int:
    from megatron_iso.cli.bisect import main

    return main(args)


TOOLS: dict[str, Callable[[list[str]], int]] = {
    "iso-train": _iso_train,
    "iso-bench": _iso_bench,
    "iso-contract": _iso_contract,
    "iso-bisect": _iso_bisect,
}


def load_trials() -> list[dict[str, Any]]:
    trials = yaml.safe_load(TRIALS.read_text(encoding="utf-8"))
    return [{"tool": "iso-train", "message": "", **t} for t in trials]


def make_files(tmp: Path) -> None:
    """The scratch files trials name as ``{tmp}/...``."""
    (tmp / "adir").mkdir(exist_ok=True)
    (tmp / "afile").write_text("a file, not a directory\n")
    (tmp / "bad.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "1"}\n')


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A scratch directory with :func:`make_files`, made the working directory (relative paths, ``runs/``)."""
    old = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="iso-hostile-") as d:
        tmp = Path(d)
        make_files(tmp)
        os.chdir(tmp)
        try:
            yield tmp
        finally:
            os.chdir(old)


def run_trial(trial: dict[str, Any], tmp: Path) -> tuple[int, str, str]:
    """(exit code, the tool's one error line or "", all of stderr) of ``trial`` in the scratch directory ``tmp``."""
    args = [a.replace("{tmp}", str(tmp)) for a in shlex.split(trial["args"] or "")]
    err, out = io.StringIO(), io.StringIO()
    env = {k: os.environ.pop(k) for k in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE") if k in os.environ}
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = TOOLS[trial["tool"]](args)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.environ.update(env)
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith(trial["tool"]) or ln.startswith("usage:")]
    line = next((ln for ln in reversed(lines) if "error" in ln or "stopped" in ln), "")
    return code, line.replace(str(tmp), "{tmp}"), err.getvalue()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def write_table(path: Path = DOC) -> None:
    """Run every trial and write the markdown table of input, outcome and message."""
    trials = load_trials()
    rows = []
    with scratch() as tmp:
        for t in trials:
            code, line, _ = run_trial(t, tmp)
            outcome = {0: "accepted (0)", 2: "refused (2)"}.get(code, f"exit {code}")
            line = line.split(": error: ", 1)[-1].replace(str(HERE.parents[1]) + "/", "")
            rows.append(f"| {t['tool']} | `{_cell(t['args'] or '(defaults)')}` | {outcome} | {_cell(line)} |")
    refused = sum(1 for r in rows if "refused (2)" in r)
    head = f"""# Hostile inputs

What each command does with bad input: {len(trials)} trials ({refused} refused with exit 2 and one line naming the
setting, {len(trials) - refused} correct inputs accepted), none a traceback (exit 4) or a silent acceptance. The
trials are data, `tests/cli/hostile_inputs.yaml` (command line, expected exit code, a substring of the message);
`tests/cli/test_hostile_inputs.py` runs them in CI through the entry point each command runs before anything
starts (iso-train: `megatron_iso.cli.train.validate`: compose, the config's schema, the typed settings, this
machine's checks). `{{tmp}}` is a scratch directory holding a file (`afile`), a directory (`adir`) and a JSON lines
file that is not UTF-8 (`bad.jsonl`). Memory figures are those of the machine that wrote the table.

The schema (`megatron_iso/settings/schema.py`): the known keys are the root config's plus, per group, the union of
the keys of all its options in `conf/`; a value takes the types the options give it. Open node (any key
below it is accepted, as it goes to another library): `data.chat_template_kwargs` (the tokenizer's
`apply_chat_template`). Ranges and shape rules: `megatron_iso/settings/` (`shapes.py` model shapes,
`resources.py` memory, world size and writable directories, `task.py` the task group).

Regenerate after changing a trial or a message: `PYTHONPATH=. python -m tests.cli.hostile_table`.

| tool | input | outcome | message |
|---|---|---|---|
"""
    path.write_text(head + "\n".join(rows) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
