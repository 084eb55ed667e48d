"""The documentation runs as written: every ```python block of README.md and docs/*.md, each standalone in a fresh
process, and the links between the pages resolve.

A block whose first line is exactly GPU_MARKER is skipped where CUDA is not available; every other block must run
on a CPU in a few seconds. Blocks run two at a time (one CPU thread each) in the order collected; each test waits
for its own block's process. Commands belong in ```bash blocks, which are not run.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

#: the first line of a block that needs a CUDA GPU
GPU_MARKER = "# needs a CUDA GPU"
#: seconds one block may take
BLOCK_TIMEOUT = 300
README_MAX_LINES = 300


def doc_pages():
    """README.md and every docs/*.md present now (other pages included), repository-relative."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _fences(text: str):
    """(info string, first line number of the body, body) of each fenced block of a markdown text."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+|~~~+)\s*([^`\s]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, info, start = opening.group(2), opening.group(3).lower(), i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        yield info, start + 1, "\n".join(lines[start:j]) + "\n"
        i = j + 1


def python_blocks():
    """pytest params: (page, line, source) of every ```python block, id `page:line`."""
    params = []
    for page in doc_pages():
        for info, line, body in _fences(page.read_text(encoding="utf-8")):
            if info in ("python", "py"):
                params.append(pytest.param(_rel(page), line, body, id=f"{_rel(page)}:{line}"))
    return params


BLOCKS = python_blocks()


def _needs_gpu(source: str) -> bool:
    return source.splitlines()[0].strip() == GPU_MARKER if source.strip() else False


def _run_block(source: str) -> tuple:
    """Run `source` as a script in a fresh interpreter (cwd: a new temp dir; the repository root on PYTHONPATH)
    -> (return code, stdout + stderr, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")      # two blocks run at once: one thread each, no oversubscription
    with tempfile.TemporaryDirectory(prefix="mxattn_doc_block_") as tmp:
        script = Path(tmp) / "block.py"
        script.write_text(source, encoding="utf-8")
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(script)], cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return None, f"timed out after {BLOCK_TIMEOUT} s\n{out}", time.perf_counter() - start
        return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


@pytest.fixture(scope="session")
def block_runs(request):
    """{(page, line): future of `_run_block`}: the selected blocks that can run here, started two at a time in
    collection order as soon as the first of them is needed."""
    selected = [item for item in request.session.items
                if getattr(item, "originalname", None) == "test_python_block" and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for item in selected:
        page, line, source = (item.callspec.params[k] for k in ("page", "line", "source"))
        if not _needs_gpu(source) or torch.cuda.is_available():
            futures[page, line] = pool.submit(_run_block, source)
    yield futures
    for future in futures.values():
        future.cancel()
    pool.shutdown(wait=True)


@pytest.mark.parametrize("page,line,source", BLOCKS)
def test_python_block(page, line, source, block_runs):
    """The block at `page:line` runs as written, alone, and exits with status 0."""
    if _needs_gpu(source) and not torch.cuda.is_available():
        pytest.skip(f"{page}:{line} needs a CUDA GPU ({GPU_MARKER!r})")
    code, output, seconds = block_runs[page, line].result()
    assert code == 0, (f"the python block at {page}:{line} failed (exit status {code}, {seconds:.1f} s):\n"
                       f"{output[-4000:]}")


def test_there_are_python_blocks():
    assert any(p.values[0] == "README.md" for p in BLOCKS), "README.md has no ```python block"


# --------------------------------------------------------------------------- README shape and links


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _headings(text: str):
    """The text of every heading outside fenced blocks."""
    in_fence = False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
        elif not in_fence:
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                yield m.group(1)


def _links(text: str):
    """(target, line number) of every markdown link outside fenced blocks and inline code."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
            yield m.group(1), number


def test_readme_is_short_with_a_table_of_contents():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    anchors = {_anchor(h) for h in _headings(text)}
    toc = re.search(r"^## Contents\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert toc, "README.md has no '## Contents' section"
    entries = re.findall(r"\]\(#([^)]+)\)", toc.group(1))
    assert len(entries) >= 5, f"the table of contents lists {len(entries)} sections"
    missing = [e for e in entries if e not in anchors]
    assert not missing, f"table of contents entries without a heading: {missing}"
    listed = set(entries)
    top = [_anchor(h[3:]) for h in re.findall(r"^## .*$", text, flags=re.M)]
    assert [a for a in top if a not in listed and a != "contents"] == [], "a section missing from the contents"


@pytest.mark.parametrize("page", [pytest.param(p, id=_rel(p)) for p in doc_pages()])
def test_relative_links_resolve(page):
    """Every relative link of the page points to an existing file (and an anchor in a page to a heading)."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for target, number in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue                              # http(s):, mailto: ...
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        if not dest.exists():
            broken.append(f"{_rel(page)}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in {
                _anchor(h) for h in _headings(dest.read_text(encoding="utf-8"))}:
            broken.append(f"{_rel(page)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs exactly the README's install-and-test command, so the two cannot drift apart."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]*pytest[^\n]*)\n```", readme)
    assert len(commands) == 1, commands
    assert commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()
