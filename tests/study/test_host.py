"""The report's reproducibility line: the host's CPU model, the JAX/jaxlib builds, the devices."""

import jax
import jaxlib

from scalestudy.study.report.host import cpu_model, host_line


def test_cpu_model_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU 9000 @ 3.0GHz\n")
    assert cpu_model(info) == "Test CPU 9000 @ 3.0GHz"
    assert cpu_model(tmp_path / "missing")  # elsewhere: the platform's processor string


def test_host_line_names_the_builds_and_devices_and_reaches_the_report_header():
    line = host_line()
    assert f"JAX {jax.__version__}, jaxlib {jaxlib.__version__}" in line
    n = len(jax.devices())
    assert f"{n} {jax.devices()[0].platform} device(s)" in line and cpu_model() in line

    from scalestudy.study.plan.spec import StudySpec
    from scalestudy.study.record.rows import RunRow
    from scalestudy.study.report import page as report

    run = RunRow.from_row({
        "run_id": "r", "name": "r", "arch": "causal_decoder", "objective": "flm", "size": "s0",
        "size_index": 0, "params_total": 1e5, "tokens": 1e6, "flops": 1e12, "loss": 2.0,
        "status": "done", "seed": 0,
    })  # fmt: skip
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), [run], {}, [])
    head = md.split("\n## ")[0]
    assert line in head
