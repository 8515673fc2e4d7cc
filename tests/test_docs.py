"""The README and the docs as a new user meets them: a short README whose links lead somewhere
and whose test command is the one CI runs. (The docs site itself is built with
`mkdocs build --strict` by .ci/run: broken links and anchors between pages fail it there.)"""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (mkdocs' default)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_short():
    words = len(README.split())
    assert words <= 2000, f"README.md has {words} words; the rest belongs in docs/"


def test_every_readme_link_leads_to_a_file_and_heading_that_exist():
    links = [link for link in LINK.findall(README) if "://" not in link]
    assert links, "the README links no docs page"
    for link in links:
        target, _, anchor = link.partition("#")
        path = REPO / target
        assert path.exists(), f"README links {link}: no {target}"
        if anchor:
            assert anchor in _anchors(path), f"README links {link}: {target} has no heading for #{anchor}"


def test_the_readme_links_a_docs_page_for_every_job():
    linked = {link.partition("#")[0] for link in LINK.findall(README)}
    for page in ("loading", "tensor-parallel", "sharded-checkpoints", "object-stores", "pull", "vllm",
                 "weight-sync", "slurm", "troubleshooting", "reliability", "api", "benchmarks"):
        assert f"docs/{page}.md" in linked, f"the README does not link docs/{page}.md"


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run ends with the README's command for a machine that has the tools, verbatim; the
    README's first command for a fresh machine is .ci/run itself."""
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert f"`{ci_lines[-1]}`" in README, ci_lines[-1]
    assert "```bash\nbash .ci/run\n```" in README
    assert ("```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . "
            "&& python -m distload demo\n```") in README


def test_every_page_the_site_navigation_lists_exists():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, flags=re.M))
    assert listed <= pages, f"mkdocs.yml lists pages that do not exist: {sorted(listed - pages)}"


def test_the_public_functions_document_their_arguments_and_results():
    """The API reference is generated from these docstrings (mkdocstrings, Google style)."""
    import inspect

    import distload

    from distload.checkpoints.reshard import reshard as reshard_by_spec

    # distload.reshard (vLLM's engine where it applies) refers to the streaming reshard for its
    # arguments; the API page shows both.
    assert "distload.checkpoints.reshard.reshard" in (inspect.getdoc(distload.reshard) or "")
    functions = {name: getattr(distload, name) for name in (
        "load", "iter_tensors", "make_load_config", "save_sharded", "inspect", "verify", "detect_layout",
        "load_spec", "load_dtensors", "state_digest")}
    functions["checkpoints.reshard.reshard"] = reshard_by_spec
    for name, function in functions.items():
        doc = inspect.getdoc(function) or ""
        assert "Args:" in doc and "Returns:" in doc, f"distload.{name}: no Args/Returns in its docstring"
        documented = set(re.findall(r"^    (\w+):", doc.split("Args:")[1].split("Returns:")[0], flags=re.M))
        params = set(inspect.signature(function).parameters)
        assert params <= documented, f"distload.{name}: {sorted(params - documented)} not under Args"
