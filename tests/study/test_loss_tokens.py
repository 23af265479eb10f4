"""The report's loss-bearing tokens per cell: measured from the data, imbalance stated."""

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.study.plan import loss_token_count
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import loss_tokens


def _cfg(arch, name, **obj):
    return ExperimentConfig(
        model={"arch": arch},
        objective={"name": name, "inputs_length": 24, "targets_length": 8, **obj},
        data={"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
        train={"batch_size": 8},
    )


def test_plm_cells_train_on_the_same_loss_tokens_per_example():
    dec = loss_token_count.measure_loss_tokens(_cfg("noncausal_decoder", "plm"))
    encdec = loss_token_count.measure_loss_tokens(_cfg("encoder_decoder", "plm"))
    # About L / 2 = 16 each (uniform split of 32-token pieces); the encoder-decoder used to
    # cut its targets at targets_length = 8.
    assert abs(dec - 16) < 2 and abs(encdec - 16) < 2
    fit = loss_token_count.measure_loss_tokens(_cfg("encoder_decoder", "plm", plm_split="fit"))
    assert 7 <= fit <= 8  # targets of exactly T = 8 for full pieces
    flm = loss_token_count.measure_loss_tokens(_cfg("causal_decoder", "flm"))
    assert 30 <= flm <= 32  # every token


def test_section_states_totals_and_imbalance():
    runs = [
        RunRow(arch="causal_decoder", objective="plm", tokens=3000.0, positions=6000.0),
        RunRow(arch="causal_decoder", objective="plm", tokens=1000.0, positions=2000.0),
        RunRow(arch="encoder_decoder", objective="plm", tokens=1000.0, positions=6000.0),
    ]
    per_example = {
        "causal_decoder/plm": 313.0,
        "encoder_decoder/plm": 103.7,
        "encoder_decoder/mlm": "no data here",
    }
    text = "\n".join(loss_tokens.lines(runs, per_example))
    assert "| causal_decoder/plm | 313.0 | 4000 | 0.500 |" in text
    assert "| encoder_decoder/plm | 103.7 | 1000 | 0.167 |" in text
    assert "| encoder_decoder/mlm | n/a | n/a | n/a |" in text
    assert "encoder_decoder/mlm: not measured (no data here)" in text
    assert "Imbalance within `plm`: encoder_decoder/plm trains on 103.7" in text
    balanced = {"causal_decoder/plm": 313.0, "encoder_decoder/plm": 310.8}
    assert "Imbalance" not in "\n".join(loss_tokens.lines(runs, balanced))
