"""Per-kind step profiles (`bench/profile.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from scalestudy.bench import profile


def _line(name: str, shape: str, opcode: str, op_name: str) -> str:
    return f'  %{name} = {shape} {opcode}(%a), metadata={{op_name="{op_name}"}}'


@pytest.mark.parametrize(
    ("shape", "opcode", "op_name", "kind"),
    [
        ("f32[16,4,32]{2,1,0}", "dot", "jit(f)/transpose(jvp())/dot_general", "matmuls"),
        ("f32[2048,384]{1,0}", "fusion", "jit(f)/transpose(jvp())/div", "vocabulary"),
        ("f32[16,4,128,128]{3,2,1,0}", "fusion", "jit(f)/jvp()/exp", "attention"),
        ("f32[512,2048]{1,0}", "fusion", "jit(f)/transpose(jvp())/add_any", "feed-forward"),
        ("f32[128,512]{1,0}", "fusion", "jit(f)/sqrt", "after the gradient"),
        ("f32[2048,128]{1,0}", "fusion", "jit(f)/jvp()/mul", "other elementwise"),
    ],
)
def test_kind_of_reads_shape_opcode_and_source(shape, opcode, op_name, kind):
    line = _line("x", shape, opcode, op_name)
    assert profile.kind_of(shape, opcode, line, vocab=384, d_ff=512).startswith(kind)


def test_profile_step_attributes_traced_time_to_the_programs_operations(tmp_path):
    def step(state, batch):
        w = state["w"]
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(batch @ w) ** 2))(w)
        return {"w": w - 1e-3 * g}, loss

    fn = jax.jit(step, donate_argnums=0)
    state = {"w": jnp.ones((64, 96)) / 8}
    batch = jnp.ones((128, 64))
    state, _ = fn(state, batch)
    state, out = profile.profile_step(fn, state, batch, 3, tmp_path, vocab=96, d_ff=1000)
    hlo = (tmp_path / "program.hlo.txt").read_text()
    assert out["top_level_ops"] == len(profile.entry_ops(hlo)) > 0
    assert out["matmuls"] > 0  # the trace named the program's dots
    assert out["total_ms"] == pytest.approx(sum(out[k] for k in profile.KINDS), abs=0.05)
    assert state["w"].shape == (64, 96)  # the state came back, usable
