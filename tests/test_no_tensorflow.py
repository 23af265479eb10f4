"""A host without TensorFlow, seqio or TFDS (a CUDA host, say) trains, evaluates and benchmarks.

One child process with the three imports blocked (as if not installed: `sys.modules[name] =
None`, so `import` fails and `importlib.util.find_spec` says absent) runs the commands a GPU
user runs on the byte and SentencePiece vocabularies; at its end none of the three is loaded.
A seqio source there fails with one line naming the extra to install.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.xdist_group("no_tensorflow")

BLOCKED = ("tensorflow", "seqio", "tensorflow_datasets")

CHILD = textwrap.dedent(
    """
    import json, sys
    for name in {blocked!r}:
        sys.modules[name] = None
    from pathlib import Path
    from scalestudy.cli.main import main
    from scalestudy.data import synthetic
    from scalestudy.data.vocab import train_sentencepiece

    tmp = Path({tmp!r})
    small = ["model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.d_ff=64",
             "train.steps=2", "train.batch_size=8", "train.eval_every=2",
             "data.synthetic.n_train_documents=60", "data.synthetic.n_validation_documents=8",
             "eval.max_examples=8"]
    codes = {{}}
    for arch, obj in [("causal_decoder", "flm"), ("noncausal_decoder", "plm"),
                      ("encoder_decoder", "mlm")]:
        run = tmp / arch
        codes[arch] = main(["train", "--config", {config!r}, "--workdir", str(run), "--eval",
                            f"model.arch={{arch}}", f"objective.name={{obj}}", *small])
    codes["eval"] = main(["eval", "--workdir", str(tmp / "causal_decoder")])
    text = tmp / "corpus.txt"
    text.write_text("\\n".join(synthetic.story(0, "train", i) for i in range(200)))
    model = train_sentencepiece([text], tmp / "spm.model", vocab_size=160)
    codes["text_spm"] = main(["train", "--config", {config!r}, "--workdir", str(tmp / "spm"),
                              "data.source=text", f"data.paths=[{{text}}]", "data.split_by=line",
                              "data.vocab=sentencepiece", f"data.spm_path={{model}}",
                              "model.vocab_size=384", *small])
    codes["bench"] = main(["bench", "peer", "--peer", "minimal", "--steps", "1",
                           "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
                           "model.d_ff=64", "train.batch_size=8"])
    codes["seqio_source"] = main(["train", "--config", {config!r}, "--workdir",
                                  str(tmp / "seqio"), "data.source=seqio",
                                  "data.seqio_task=scalestudy.synthetic.flm", *small])
    codes["eval_tfds"] = main(["eval", "--workdir", str(tmp / "causal_decoder"), "--tasks",
                               "super_glue/copa"])
    loaded = [m for m in {blocked!r} if sys.modules.get(m) is not None]
    print("RESULT", json.dumps({{"codes": codes, "loaded": loaded}}))
    """
)


def test_training_evaluation_and_bench_need_no_tensorflow(tmp_path):
    code = CHILD.format(
        blocked=BLOCKED, tmp=str(tmp_path), config="configs/experiments/synthetic_tiny.yaml"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    codes = result.pop("codes")
    assert codes.pop("seqio_source") == 2
    assert codes.pop("eval_tfds") == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    # a TFDS evaluation task names what is missing and the released file to score instead,
    # not a training source
    (tfds_error,) = [ln for ln in errors if "super_glue/copa" in ln]
    assert "tensorflow" in tfds_error and "copa:PATH" in tfds_error, tfds_error
    assert "train from" not in tfds_error
    assert codes == dict.fromkeys(codes, 0), (codes, errors)
    assert result["loaded"] == []
    assert "pip install 'scalestudy[seqio]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    for arch in ("causal_decoder", "noncausal_decoder", "encoder_decoder"):
        summary = json.loads((tmp_path / arch / "summary.json").read_text())
        assert summary["complete"] and summary["final_val_loss"] > 0
        assert (tmp_path / arch / "eval_examples").is_dir()  # scored on the built-in probes
