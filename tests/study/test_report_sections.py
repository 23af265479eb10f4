"""The study report's page is assembled in one place: `page.SECTIONS`, joined by `page.page`."""

import ast
import inspect
from pathlib import Path

from scalestudy.study.plan.spec import StudySpec
from scalestudy.study.report import page


def test_every_section_of_the_page_takes_the_reports_inputs_and_returns_lines():
    assert len(page.SECTIONS) == len(set(page.SECTIONS))
    for section in page.SECTIONS:
        sig = inspect.signature(section, eval_str=True)
        assert [p.annotation for p in sig.parameters.values()] == [page.ReportInputs], section
        assert sig.return_annotation == list[str], section


def test_the_page_is_joined_once_from_the_section_list():
    tree = ast.parse(Path(page.__file__).read_text())
    joins = [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "join"
        and isinstance(call.func.value, ast.Constant)
        and call.func.value.value == "\n"
    ]
    assert joins == ["page"]
    assert "text +=" not in Path(page.__file__).read_text()


def test_a_page_without_a_folder_is_its_sections_lines_and_an_empty_section_adds_nothing():
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    inputs = page.ReportInputs.of(study, [])
    lines = [line for section in page.SECTIONS for line in section(inputs)]
    assert page.page(inputs) == "\n".join(lines) == page.render_markdown(study, [], {}, [])
    assert lines[0] == "# Study `t`" and "## Runs" in lines
    assert page.zero_shot_section(inputs) == page.expert_section(inputs) == []
