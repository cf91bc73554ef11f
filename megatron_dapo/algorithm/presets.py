"""`algorithm.preset`: the recipes that tell GRPO from DAPO, each a setting of every switch between them.

A preset fills the switches the config leaves unset; a switch the config sets overrides it (so "grpo" with
loss.eps_high 0.28 is GRPO with clip-higher, an arm of the paper's ablation). What a preset refuses is a key that
only means something when a switch is on, given while the preset turns that switch off (loss.kl_type under
"dapo", which has no KL term): the key would be silently ignored. Without algorithm.preset the keys' own
defaults apply, which are DAPO's.
"""

from __future__ import annotations

import logging

from megatron_dapo.config import ConfigError

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, object]] = {
    # The paper's: clip-higher, token-level loss, soft overlong punishment, dynamic sampling, no KL term.
    "dapo": {"loss.eps_low": 0.2, "loss.eps_high": 0.28, "loss.aggregation": "token",
             "algorithm.overlong_penalty": True, "algorithm.overlong_filter": False,
             "algorithm.dynamic_sampling": True, "loss.kl_coef": 0.0},
    # GRPO as DeepSeekMath defines it: symmetric clipping, the sample-level loss, the length left alone, every
    # group trained on, a KL term (k3, beta 0.04) against the initial policy. DeepSeek-R1's variant refreshes
    # that reference: loss.kl_ref_refresh_steps.
    "grpo": {"loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.aggregation": "sample",
             "algorithm.overlong_penalty": False, "algorithm.overlong_filter": False,
             "algorithm.dynamic_sampling": False, "loss.kl_coef": 0.04, "loss.kl_type": "k3"},
}

# key -> (the switch it belongs to, is the switch on at this value, what the key does)
DEPENDENT_KEYS = {
    "algorithm.oversample_factor": ("algorithm.dynamic_sampling", bool, "draws extra prompts for dynamic sampling"),
    "algorithm.overlong_cache_len": ("algorithm.overlong_penalty", bool, "is the soft overlong penalty's interval"),
    "loss.kl_type": ("loss.kl_coef", lambda v: v > 0, "chooses the KL term's estimator"),
    "loss.kl_ref_refresh_steps": ("loss.kl_coef", lambda v: v > 0, "refreshes the KL term's reference"),
}

_MISSING = object()


def _get(data: dict, key: str):
    section, name = key.split(".")
    values = data.get(section)
    return values.get(name, _MISSING) if isinstance(values, dict) else _MISSING


def apply_preset(data: dict) -> None:
    """Resolve algorithm.preset in a raw config (the YAML's dict, overrides applied), in place: the preset's values
    for the switches not set, and the key itself removed. Refuses an unknown preset, and a key given for a switch
    that the preset turns off, naming both."""
    algorithm = data.get("algorithm")
    if not isinstance(algorithm, dict) or "preset" not in algorithm:
        return
    name = algorithm.pop("preset")
    if name not in PRESETS:
        raise ConfigError(f"algorithm.preset: must be one of {', '.join(map(repr, PRESETS))}, got {name!r}")
    preset = PRESETS[name]
    explicit = {key for key in preset if _get(data, key) is not _MISSING}
    for key, (switch, is_on, what) in DEPENDENT_KEYS.items():
        if _get(data, key) is not _MISSING and switch in preset and switch not in explicit and not is_on(preset[switch]):
            raise ConfigError(f"{key}: {what}, but algorithm.preset {name!r} sets {switch} to "
                              f"{preset[switch]!r} (off); set {switch} as well, or remove {key}")
    for key, value in preset.items():
        if key not in explicit:
            section, field = key.split(".")
            data.setdefault(section, {})[field] = value
    overridden = {key: _get(data, key) for key in sorted(explicit) if _get(data, key) != preset[key]}
    log.info("algorithm.preset %r%s", name, "".join(f", {k}={v!r} (overridden)" for k, v in overridden.items()))
