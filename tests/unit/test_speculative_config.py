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


def test_speculative_config_json_maps_onto_the_same_config():
    args = serve_parser().parse_args([
        "--speculative-config",
        '{"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 3}'])
    spec = engine_config(args).speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == (
        "eagle3", "/heads/e3", 3)
    # vLLM's name for the draft-model method; the JSON wins over the separate flags
    args = serve_parser().parse_args([
        "--speculative-method", "suffix", "--speculative-max-batch", "2", "--speculative-config",
        '{"method": "draft_model", "model": "m", "max_batch": 3}'])
    spec = engine_config(args).speculative
    assert (spec.method, spec.draft_model, spec.max_batch) == ("draft", "m", 3)


@pytest.mark.parametrize("text, match", [
    ('{"method": "eagle3", "model": "/x", "modle": 1}', "unknown key 'modle'"),
    ('{"prompt_lookup_max": 4}', "unknown key 'prompt_lookup_max'"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 33}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be int"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be int"),
    ('{"method": "medusa"}', "speculative_method"),
    ('{"model": 3}', "model must be str"),
    ('[1, 2]', "JSON object"),
    ('{"method": ', "not JSON"),
])
def test_bad_speculative_config_json_is_refused_naming_the_key(capsys, text, match):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--speculative-config", text])
    assert match in capsys.readouterr().err


def test_eagle3_needs_its_head():
    with pytest.raises(ValueError, match="speculative_draft_model"):
        engine_config(serve_parser().parse_args(["--speculative-config", '{"method": "eagle3"}']))
