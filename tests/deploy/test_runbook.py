"""deploy/README.md keeps up with what it documents: the alerts, the repository's files, the CLI.

The runbook is read when an alert pages. An alert added without its section, a section left
behind by a rename, a file that moved or a flag that no longer exists is found here, in CI,
rather than by the SRE following it.
"""

from __future__ import annotations

import argparse
import re
import shlex

import pytest
import yaml

from gateway.cli import build_parser
from tests.deploy.conftest import ALERTS, DEPLOY

ROOT = DEPLOY.parent
RUNBOOK = DEPLOY / "README.md"
PARTS = ("**What it means.**", "**Look at.**", "**Do.**")
SHELL_OPERATORS = {"|", "||", "&&", ";", "<", ">", ">>", "&"}
# A relative path with at least one slash, whose first segment has no dot inside it (so that
# `kubernetes.io/hostname` is a label, not a file): `deploy/README.md`, `.ci/run`, `deploy/compose/`.
PATH = re.compile(r"\.?[\w-]+(?:/[\w.-]+)*/?")


def alerts() -> dict[str, dict[str, str]]:
    """Each alert's name and annotations, from the rules Prometheus loads."""
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    return {rule["alert"]: rule.get("annotations", {}) for rule in rules if "alert" in rule}


def prose_and_code(markdown: str) -> tuple[list[str], list[str]]:
    """The lines outside fenced code blocks, and those inside (a `#` there is a shell comment)."""
    prose: list[str] = []
    code: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def sections(prose: list[str]) -> list[tuple[int, str, str]]:
    """(level, title, body up to the next heading) for every heading."""
    found: list[tuple[int, str, list[str]]] = []
    for line in prose:
        heading = re.fullmatch(r"(#{1,6}) (.+?)\s*", line)
        if heading:
            found.append((len(heading[1]), heading[2], []))
        elif found:
            found[-1][2].append(line)
    return [(level, title, "\n".join(body)) for level, title, body in found]


def github_anchor(title: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")


def anchors(titles: list[str]) -> set[str]:
    """Every heading's id, a repeated one suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    ids = set()
    for title in titles:
        slug = github_anchor(title)
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def runbook_sections(markdown: str) -> dict[str, str]:
    """The level-3 sections under the level-2 heading "Runbook", by title."""
    found: dict[str, str] = {}
    inside = False
    for level, title, body in sections(prose_and_code(markdown)[0]):
        if level <= 2:
            inside = title == "Runbook"
        elif inside and level == 3:
            found[title] = body
    return found


def named_paths(markdown: str) -> set[str]:
    """Inline code spans that name a file or directory of the repository."""
    spans = re.findall(r"`([^`\n]+)`", "\n".join(prose_and_code(markdown)[0]))
    return {span for span in spans if "/" in span and PATH.fullmatch(span)}


def command_lines(markdown: str) -> list[str]:
    """Every `inference-gateway ...` command, in code blocks and inline code."""
    prose, code = prose_and_code(markdown)
    inline = re.findall(r"`(inference-gateway [^`\n]+)`", "\n".join(prose))
    return [line.strip() for line in code if line.strip().startswith("inference-gateway ")] + inline


def parse_command(line: str) -> argparse.Namespace:
    """The line's words up to the first shell operator, through the gateway's own parser (which
    exits 2 on an unknown command or flag, as the shell would see it)."""
    words = shlex.split(line, comments=True)[1:]
    for index, word in enumerate(words):
        if word in SHELL_OPERATORS:
            words = words[:index]
            break
    return build_parser(words[0]).parse_args(words)


def test_every_alert_has_a_runbook_section_with_what_it_means_what_to_look_at_and_what_to_do() -> None:
    documented = runbook_sections(RUNBOOK.read_text())
    missing = sorted(set(alerts()) - set(documented))
    assert missing == [], f"alerts without a '### <alert name>' section under '## Runbook': {missing}"
    for name in alerts():
        body = documented[name]
        places = [body.find(part) for part in PARTS]
        assert -1 not in places, f"{name}: needs each of {PARTS}"
        assert places == sorted(places), f"{name}: {PARTS} out of order"


def test_every_runbook_section_names_an_alert_that_exists() -> None:
    stale = sorted(set(runbook_sections(RUNBOOK.read_text())) - set(alerts()))
    assert stale == [], f"runbook sections for alerts that alerts.yaml no longer has: {stale}"


def test_every_alert_links_its_runbook_section() -> None:
    prose = prose_and_code(RUNBOOK.read_text())[0]
    ids = anchors([title for _, title, _ in sections(prose)])
    for name, annotated in alerts().items():
        url = annotated.get("runbook_url", "")
        assert url == f"deploy/README.md#{github_anchor(name)}", f"{name}: runbook_url {url!r}"
        assert url.partition("#")[2] in ids, f"{name}: {url} is not a heading of deploy/README.md"


def test_every_file_the_runbook_names_exists() -> None:
    paths = named_paths(RUNBOOK.read_text())
    assert len(paths) >= 20, f"the path pattern found only {sorted(paths)}"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], f"deploy/README.md names files that do not exist: {missing}"


def test_every_inference_gateway_command_in_the_runbook_parses() -> None:
    lines = command_lines(RUNBOOK.read_text())
    assert len(lines) >= 3, lines
    for line in lines:
        try:
            parse_command(line)
        except SystemExit as exit_:
            pytest.fail(f"deploy/README.md: `{line}` is refused by the gateway's parser (exit {exit_.code})")


@pytest.mark.parametrize(
    "line",
    [
        "inference-gateway policy validate --strikt policy.yaml",
        "inference-gateway serve --workers 2",
        "inference-gateway policy lint policy.yaml",
    ],
    ids=["a misspelt flag", "a missing required flag", "an unknown sub-command"],
)
def test_the_command_check_refuses_a_line_the_cli_would_refuse(line: str) -> None:
    with pytest.raises(SystemExit):
        parse_command(line)


def test_the_anchors_are_githubs() -> None:
    assert github_anchor("GatewaySLOFastBurn") == "gatewayslofastburn"
    assert github_anchor("Policy change: roll out safely, roll back") == "policy-change-roll-out-safely-roll-back"
    assert anchors(["Do", "Do"]) == {"do", "do-1"}
