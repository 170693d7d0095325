"""Bad speculative-decoding settings are refused with the field named, at config and CLI."""

import pytest

from hearth.flags import engine_config, serve_parser
from hearth.config import SpeculativeConfig


@pytest.mark.parametrize("kw, match", [
    (dict(method="eagle"), "speculative_method"),
    (dict(method="draft"), "speculative_draft_model"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=33), "num_speculative_tokens"),
    (dict(ngram_min=4, ngram_max=2), "ngram"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kw)


def test_cli_flags_reach_the_config_and_bad_ones_are_refused():
    args = serve_parser().parse_args(["--speculative-method", "suffix",
                                      "--num-speculative-tokens", "4"])
    spec = engine_config(args).speculative
    assert (spec.method, spec.num_speculative_tokens) == ("suffix", 4)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--speculative-method", "eagle"])
    with pytest.raises(ValueError, match="speculative_draft_model"):
        engine_config(serve_parser().parse_args(["--speculative-method", "draft"]))
