"""tools/convert_checkpoint.py: HF <-> megatron-core distributed checkpoints at TP=2 x PP=2 (a mixture of experts,
Qwen3-MoE, Qwen2-MoE or GLM-4.5, at TP=2 x EP=2 x PP=2), for real: the files equal megatron-core's own save,
megatron-core loads them at other layouts, and conversion streams."""

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from bench_convert import measured  # noqa: E402  (a conversion's time and peak memory, in a fresh process)
from tiny_models import hf_model  # noqa: E402

from megatron_dapo.checkpoint.convert import hf_to_mcore, mcore_to_hf  # noqa: E402
from megatron_dapo.checkpoint.hf_mapping import MappingError  # noqa: E402
from megatron_dapo.checkpoint.safetensors_io import CheckpointError, HFCheckpoint  # noqa: E402
from megatron_dapo.config import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow
TOOL = Path(__file__).parents[1] / "tools" / "convert_checkpoint.py"


MOE_KINDS = ["qwen3_moe", "qwen2_moe", "glm4_moe"]
KINDS = ["qwen2_tied", "qwen2", "llama", "qwen3", *MOE_KINDS]
# (TP, EP, PP) each kind is converted at; a mixture of experts' experts are dealt over 2 expert-parallel ranks too.
SAVED_AT = {kind: (2, 2, 2) if kind in MOE_KINDS else (2, 1, 2) for kind in KINDS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """kind -> a folder with the HF model (hf/), converted at its SAVED_AT layout (mcore/) and back (back/)."""
    roots = {}
    for kind in KINDS:
        root = roots[kind] = tmp_path_factory.mktemp(f"convert_{kind}")
        model, _ = hf_model(kind)
        model.save_pretrained(root / "hf", max_shard_size="60KB")
        (root / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 96}')
        # One direction through the command-line tool, the other through the API.
        tp, ep, pp = SAVED_AT[kind]
        subprocess.run([sys.executable, str(TOOL), "hf-to-mcore", "--input", str(root / "hf"), "--output",
                        str(root / "mcore"), "--tp", str(tp), "--ep", str(ep), "--pp", str(pp)], check=True,
                       capture_output=True, text=True)
        mcore_to_hf(root / "mcore", root / "back", max_shard_bytes=100_000)
    return roots


@pytest.fixture(scope="module", params=KINDS)
def converted(request, checkpoints):
    return request.param, checkpoints[request.param]


@pytest.fixture(scope="module")
def loaded(checkpoints, tmp_path_factory) -> dict[str, dict]:
    """kind -> {layout: the log-probs' agreement with transformers}: every kind in one torchrun start."""
    out = tmp_path_factory.mktemp("loaded")
    torchrun("mcore_load_worker.py", 4, str(out), *(f"{k}={root / 'mcore'}" for k, root in checkpoints.items()))
    merged = {k: {} for k in checkpoints}
    for f in out.glob("rank*.json"):
        for kind, layouts in json.loads(f.read_text()).items():
            merged[kind].update(layouts)
    return merged


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """kind -> megatron-core's own save of the HF model at its SAVED_AT layout: every kind in one torchrun start."""
    refs = {k: tmp_path_factory.mktemp(f"ref_{k}") for k in checkpoints}
    torchrun("mcore_save_worker.py", 4, *(f"{root / 'hf'}={refs[k]}@{','.join(map(str, SAVED_AT[k]))}"
                                          for k, root in checkpoints.items()))
    return refs


@pytest.mark.smoke
def test_round_trip_is_bitwise_identical(converted):
    kind, root = converted
    src, back = HFCheckpoint(root / "hf"), HFCheckpoint(root / "back")
    assert sorted(back.names()) == sorted(src.names())
    for name in src.names():
        assert torch.equal(back.get(name), src.get(name)), name
    assert back.config == src.config
    assert (root / "back" / "tokenizer_config.json").read_text() == '{"model_max_length": 96}'
    meta = json.loads((root / "mcore" / "megatron_dapo.json").read_text())
    assert (meta["tensor_parallel"], meta["expert_parallel"], meta["pipeline_parallel"]) == SAVED_AT[kind]


def test_transformers_loads_the_result(converted):
    from transformers import AutoModelForCausalLM

    kind, root = converted
    model, _ = hf_model(kind)
    reloaded = AutoModelForCausalLM.from_pretrained(root / "back").eval()
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_loaded_at_other_layouts_matches_transformers(converted, loaded):
    kind, _ = converted
    merged = loaded[kind]
    # A mixture of experts saved at TP2 x EP2 x PP2 loads whole, and with each expert alone on its rank.
    assert set(merged) == ({"tp1-ep1-pp1", "tp1-ep4-pp1"} if kind in MOE_KINDS else {"tp1-ep1-pp1", "tp2-ep1-pp2"})
    for layout, r in merged.items():
        assert r["tokens"] == 138 and r["max_abs_logp"] < 1e-4, (layout, r)


def _stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a distributed checkpoint, whole (its extra-state objects left out), through torch's own
    loader rather than the converter's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as meant
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _same_checkpoint(a: Path, b: Path):
    """Same keys, global shapes, dtypes and chunks, and equal tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ma = FileSystemReader(str(a)).read_metadata().state_dict_metadata
    mb = FileSystemReader(str(b)).read_metadata().state_dict_metadata
    assert sorted(ma) == sorted(mb)
    for key, x in ma.items():
        y = mb[key]
        assert type(x) is type(y), key
        if isinstance(x, TensorStorageMetadata):
            assert (x.size, x.properties.dtype) == (y.size, y.properties.dtype), key
            chunks = [sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks) for m in (x, y)]
            assert chunks[0] == chunks[1], key
    ta, tb = _stored_tensors(a), _stored_tensors(b)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_files_equal_megatron_cores_own_save(converted, references, tmp_path):
    kind, root = converted
    ref = references[kind]
    _same_checkpoint(root / "mcore", ref)
    # And a checkpoint megatron-core wrote (a trainer checkpoint's model folder) converts back to the same HF
    # tensors, through the command line's own entry.
    from megatron_dapo.checkpoint.convert import main

    for name in ("megatron_dapo.json", "hf"):
        src = root / "mcore" / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, ref / name)
    assert main(["mcore-to-hf", "--input", str(ref), "--output", str(tmp_path / "back")]) == 0
    src, back = HFCheckpoint(root / "hf"), HFCheckpoint(tmp_path / "back")
    assert sorted(back.names()) == sorted(src.names())
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.names())


def test_bf16_round_trip_keeps_dtype_and_bits(tmp_path):
    model, _ = hf_model("llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=1, pp=2)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    src, back = HFCheckpoint(tmp_path / "hf"), HFCheckpoint(tmp_path / "back")
    assert sorted(back.names()) == sorted(src.names())
    for name in src.names():
        a, b = src.get(name), back.get(name)
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_llama3_round_trip_is_bitwise_and_keeps_the_rope_parameters(tmp_path):
    """Llama 3.2-shaped (rope_type llama3, factor 32, tied embeddings) at TP=2 x PP=2 and back."""
    model, _ = hf_model("llama32")
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=2, pp=2)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_bytes=100_000)
    src, back = HFCheckpoint(tmp_path / "hf"), HFCheckpoint(tmp_path / "back")
    assert sorted(back.names()) == sorted(src.names())
    for name in src.names():
        assert torch.equal(back.get(name), src.get(name)), name
    assert back.config == src.config and back.config["rope_parameters"]["rope_type"] == "llama3"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    model, cfg = hf_model("qwen2")
    model.save_pretrained(root / "hf", max_shard_size="60KB")
    return root / "hf", cfg


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _nothing_written(out: Path):
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def test_truncated_safetensors(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated"):
        hf_to_mcore(bad, tmp_path / "out", tp=2, pp=2)
    assert _nothing_written(tmp_path / "out")


def _with_unknown_tensor(src, dst):
    from safetensors.torch import save_file

    bad = _copy(src, dst)
    save_file({"model.layers.9.self_attn.q_proj.weight": torch.zeros(64, 64)}, str(bad / "x.safetensors"))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.self_attn.q_proj.weight"] = "x.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    return bad


def test_unknown_tensor_name(source, tmp_path):
    bad = _with_unknown_tensor(source[0], tmp_path / "bad")
    with pytest.raises(MappingError, match="model.layers.9.self_attn.q_proj.weight"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_shape_disagreeing_with_config(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**source[1], "hidden_size": 32}))
    with pytest.raises(MappingError, match="config.json implies"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_unsupported_architecture(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**source[1], "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ConfigError, match="architectures"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_expert_parallel_sizes_that_do_not_fit(source, checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="num_experts: 4 is not divisible by parallel.expert_parallel = 3"):
        hf_to_mcore(checkpoints["qwen3_moe"] / "hf", tmp_path / "out", tp=1, ep=3, pp=1)
    with pytest.raises(ConfigError, match="parallel.expert_parallel: 2, but Qwen2ForCausalLM is a dense model"):
        hf_to_mcore(source[0], tmp_path / "out", tp=1, ep=2, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_a_transformer_engine_models_expert_layers_convert_back(checkpoints, tmp_path):
    """A trainer with Transformer Engine (on GPUs) stores the pre-MLP norm of a layer with experts under its own
    module's name, not fused into linear_fc1 as the local spec's and TE's dense layers do."""
    import torch.distributed.checkpoint as dcp

    root = checkpoints["qwen3_moe"]
    state = _stored_tensors(root / "mcore")
    sparse = [0, 2, 3]  # mlp_only_layers=[1]
    for i in sparse:
        state[f"decoder.layers.{i}.pre_mlp_layernorm.weight"] = state.pop(f"decoder.layers.{i}.mlp.linear_fc1."
                                                                          "layer_norm_weight")
    te = tmp_path / "te"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(te)), no_dist=True)
    for name in ("megatron_dapo.json", "hf"):
        src = root / "mcore" / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, te / name)
    mcore_to_hf(te, tmp_path / "back")
    src, back = HFCheckpoint(root / "hf"), HFCheckpoint(tmp_path / "back")
    assert sorted(back.names()) == sorted(src.names())
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.names())


def test_config_that_is_not_the_mixture_of_experts_checkpoints_model(checkpoints, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((checkpoints["qwen3_moe"] / "hf" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 48}))
    with pytest.raises(CheckpointError, match=r"decoder.layers.0.mlp.experts.experts.linear_fc1.weight has shape "
                                              r"\(4, 64, 64\) but config.json implies \(4, 96, 64\)"):
        mcore_to_hf(checkpoints["qwen3_moe"] / "mcore", tmp_path / "out", hf_config=other)
    assert _nothing_written(tmp_path / "out")


def test_output_that_already_holds_a_checkpoint(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        hf_to_mcore(source[0], out, tp=1, pp=1)
    assert [p.name for p in out.iterdir()] == ["metadata.json"]
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        mcore_to_hf(tmp_path, source[0])


def test_sizes_that_do_not_divide(source, tmp_path):
    with pytest.raises(ConfigError, match="num_attention_heads"):
        hf_to_mcore(source[0], tmp_path / "out", tp=8, pp=1)
    assert _nothing_written(tmp_path / "out")


@pytest.fixture(scope="module")
def source_mcore(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_mcore") / "mcore"
    hf_to_mcore(source[0], out, tp=2, pp=1)
    return out


def test_truncated_distributed_checkpoint(source_mcore, tmp_path):
    bad = _copy(source_mcore, tmp_path / "bad")
    data = max(bad.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        mcore_to_hf(bad, tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


def test_config_that_is_not_the_checkpoints_model(source, source_mcore, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**source[1], "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"linear_fc1.weight has shape \(4, 192, 64\) but config.json implies"):
        mcore_to_hf(source_mcore, tmp_path / "out", hf_config=other)
    (other / "config.json").write_text(json.dumps({**source[1], "num_hidden_layers": 5}))
    with pytest.raises(CheckpointError, match="config.json implies"):
        mcore_to_hf(source_mcore, tmp_path / "out", hf_config=other)
    assert _nothing_written(tmp_path / "out")


# Issue 49: another model of the same shapes; the config.json written was its, with exit 0.
SAME_SHAPES_OTHER_VALUES = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "rms_norm_eps": 1e-3,
                            "max_position_embeddings": 4096}
SAID_DIFFERENT = ["rope_theta=10000.0 (--hf-config: 500000.0)", "rms_norm_eps=1e-05 (--hf-config: 0.001)",
                  "max_position_embeddings=96 (--hf-config: 4096)"]


def test_a_config_of_the_same_shapes_with_other_values_is_refused_naming_them(source, source_mcore, tmp_path):
    """--hf-config is checked against the checkpoint's own record: its hf/config.json, or, for a trainer checkpoint's
    model/, the model in trainer_state.json beside it; --allow-config-mismatch writes it anyway."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**source[1], **SAME_SHAPES_OTHER_VALUES}))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as refused:
        mcore_to_hf(source_mcore, out, hf_config=other)
    said = str(refused.value)
    assert said.startswith(f"--hf-config {other}: not the model the checkpoint was saved from "
                           f"({source_mcore / 'hf' / 'config.json'}): "), said
    assert all(difference in said for difference in SAID_DIFFERENT), said
    assert "--allow-config-mismatch" in said and _nothing_written(out)

    # A trainer checkpoint's model folder: no hf/ inside, the record is trainer_state.json beside it.
    step = tmp_path / "checkpoints" / "step_000002"
    shutil.copytree(source_mcore, step / "model", ignore=shutil.ignore_patterns("hf"))
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    spec = dataclasses.asdict(model_spec_from_hf(source[1]))
    (step / "trainer_state.json").write_text(json.dumps({"format": 1, "step": 2, "model": spec}))
    with pytest.raises(CheckpointError, match=f"saved from \\({step / 'trainer_state.json'}\\): .*rope_theta="):
        mcore_to_hf(step / "model", out, hf_config=other)
    assert _nothing_written(out)
    mcore_to_hf(step / "model", out, hf_config=source[0])  # the right model passes

    forced = tmp_path / "forced"
    mcore_to_hf(source_mcore, forced, hf_config=other, allow_config_mismatch=True)
    assert json.loads((forced / "config.json").read_text())["rope_parameters"]["rope_theta"] == 500000.0


def test_weights_that_are_not_finite_are_not_exported(source_mcore, tmp_path, monkeypatch):
    """A NaN anywhere in the weights: no Hugging Face folder (it would load and sample garbage), no leftover."""
    from megatron_dapo.checkpoint import convert

    hf_tensors = convert.hf_tensors

    def poisoned(mname, shards, spec):
        tensors = hf_tensors(mname, shards, spec)
        return {k: t.clone().fill_(float("nan")) if "layers.1.mlp" in k else t for k, t in tensors.items()}

    monkeypatch.setattr(convert, "hf_tensors", poisoned)
    with pytest.raises(CheckpointError, match=r"not written: tensor 'model.layers.1.mlp.\w+.weight' holds NaN"):
        mcore_to_hf(source_mcore, tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


def test_a_full_disk_is_said_as_such_and_nothing_is_left(source, tmp_path, monkeypatch):
    """Issue 49: a disk that fills up during a conversion was reported as torch's 'unexpected pos'. The writer's
    failure is injected: ENOSPC itself, and torch's own words for it with (as a full disk leaves) no space left."""
    import errno

    from megatron_dapo.checkpoint import atomic_output, convert

    def filling(directory, *args, **kwargs):
        (directory / "__0_0.distcp").write_bytes(b"x" * 1000)
        raise failure

    monkeypatch.setattr(convert, "write_mcore_checkpoint", filling)
    out = tmp_path / "out"
    for failure in (OSError(errno.ENOSPC, "No space left on device"),
                    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4308")):
        if isinstance(failure, RuntimeError):  # the disk as it is then: less than the threshold free
            monkeypatch.setattr(atomic_output, "LOW_SPACE_BYTES", shutil.disk_usage(tmp_path).free + 2**30)
        with pytest.raises(OSError, match=rf"no space left in {tmp_path} while writing out \(\d+ MiB free then; the "
                                          r"partial output is removed\): free space there, or write elsewhere"):
            hf_to_mcore(source[0], out, tp=2, pp=2)
        assert _nothing_written(out)
    monkeypatch.setattr(atomic_output, "LOW_SPACE_BYTES", 0)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # with space left it is not the disk: said as it is
        hf_to_mcore(source[0], out, tp=2, pp=2)


def test_the_partial_output_of_a_killed_conversion_is_swept_by_the_next(source, tmp_path):
    """A conversion killed midway leaves its hidden partial folder (hundreds of GB at scale); the next one into the
    same folder removes it, if its process is gone and it was this host's (another host's may still be writing)."""
    import os
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    dead = tmp_path / f".big.partial-{host}-{gone.pid}"
    older = tmp_path / f".bigger.partial-{gone.pid}"  # named as before the host was in the name
    elsewhere = tmp_path / f".big.partial-another-host-{gone.pid}"
    running = tmp_path / f".big.partial-{host}-{os.getppid()}"
    for folder in (dead, older, elsewhere, running):
        (folder / "shard").mkdir(parents=True)
    hf_to_mcore(source[0], tmp_path / "out", tp=2, pp=2)
    assert not dead.exists() and not older.exists()
    assert elsewhere.exists() and running.exists()
    assert (tmp_path / "out" / "megatron_dapo.json").is_file()


def test_not_a_distributed_checkpoint(source, tmp_path):
    with pytest.raises(CheckpointError, match="not a megatron-dapo distributed checkpoint"):
        mcore_to_hf(source[0], tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


# A model of 16 equal layers of 16.8 MB (fp32): streaming holds about one of them, never the 269 MB.
BIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=2048,
           num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
           max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32")

def test_conversion_streams_about_one_layer(tmp_path):
    from megatron_dapo.checkpoint.hf_mapping import expected_hf_names, hf_shape
    from megatron_dapo.checkpoint.safetensors_io import write_hf_checkpoint
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    spec = model_spec_from_hf(BIG)
    g = torch.Generator().manual_seed(0)
    tensors = ((n, torch.randn(hf_shape(n, spec), generator=g)) for n in sorted(expected_hf_names(spec)))
    write_hf_checkpoint(tmp_path / "hf", tensors, config=BIG, max_shard_bytes=64 * 2**20)
    model_mb = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors")) / 2**20
    to_mcore = measured(f"hf_to_mcore({str(tmp_path / 'hf')!r}, {str(tmp_path / 'm')!r}, tp=2, pp=2)")[1]
    to_hf = measured(f"mcore_to_hf({str(tmp_path / 'm')!r}, {str(tmp_path / 'back')!r}, "
                     f"max_shard_bytes={32 * 2**20})")[1]
    # One layer is 16.8 MB, its largest tensor (fc1) 8.4 MB; the HF writer holds up to one 32 MB shard.
    assert model_mb > 260
    assert to_mcore < 64, (to_mcore, model_mb)
    assert to_hf < 112, (to_hf, model_mb)
    src, back = HFCheckpoint(tmp_path / "hf"), HFCheckpoint(tmp_path / "back")
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.names())


@pytest.fixture
def run_dir(tmp_path):
    """A training run's output as the trainer leaves it: two complete checkpoints and a leftover of a third."""
    from megatron_dapo.checkpoint.trainer_checkpoint import MARKER, checkpoint_name

    root = tmp_path / "runs" / "x" / "checkpoints"
    for step in (40, 20):
        (root / checkpoint_name(step) / "model").mkdir(parents=True)
        (root / checkpoint_name(step) / MARKER).write_text("")
    (root / f"{checkpoint_name(60)}.tmp" / "model").mkdir(parents=True)
    return tmp_path


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_missing_input_lists_the_checkpoints_beside_it(run_dir):
    # As a user types it: the tool, a relative path, a step number as written in a log.
    done = subprocess.run([sys.executable, str(TOOL), "mcore-to-hf", "--input", "runs/x/checkpoints/step_40/model",
                           "--output", "hf"], cwd=run_dir, capture_output=True, text=True)
    assert done.returncode != 0
    assert _one_error_line(done.stderr) == ("error: --input runs/x/checkpoints/step_40/model does not exist; "
                                            "checkpoints in runs/x/checkpoints: step_000020, step_000040")
    assert not (run_dir / "hf").exists()


def test_missing_input_under_a_run_lists_its_checkpoints(run_dir, capsys, monkeypatch):
    from megatron_dapo.cli import main as cli_main

    monkeypatch.chdir(run_dir)
    assert cli_main(["convert", "mcore-to-hf", "--input", "runs/x/step_000040/model", "--output", "hf"]) != 0
    assert _one_error_line(capsys.readouterr().err) == (
        "error: --input runs/x/step_000040/model does not exist; checkpoints in runs/x/checkpoints: step_000020, "
        "step_000040")
    assert cli_main(["convert", "mcore-to-hf", "--input", "runs/x/checkpoints/step_000040/models", "--output",
                     "hf"]) != 0
    assert _one_error_line(capsys.readouterr().err) == (
        "error: --input runs/x/checkpoints/step_000040/models does not exist; checkpoints in runs/x/checkpoints: "
        "step_000020, step_000040")


def test_missing_input_without_checkpoints_says_where_it_looked(run_dir, capsys):
    from megatron_dapo.checkpoint.convert import main

    assert main(["mcore-to-hf", "--input", str(run_dir / "elsewhere" / "model"), "--output", str(run_dir / "hf")]) != 0
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: --input {run_dir / 'elsewhere' / 'model'} does not exist; no checkpoints folder in {run_dir}")
    (run_dir / "runs" / "y" / "checkpoints").mkdir(parents=True)
    assert main(["mcore-to-hf", "--input", str(run_dir / "runs/y/checkpoints/step_000040/model"), "--output",
                 str(run_dir / "hf")]) != 0
    assert _one_error_line(capsys.readouterr().err) == (
        f"error: --input {run_dir / 'runs/y/checkpoints/step_000040/model'} does not exist; no complete checkpoints "
        f"in {run_dir / 'runs/y/checkpoints'}")


def _bad_inputs(source, source_mcore, tmp_path):
    """(arguments, what the one error line says) for each mistake a user can make."""
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    other_values = tmp_path / "other_values"
    other_values.mkdir()
    (other_values / "config.json").write_text(json.dumps({**source[1], **SAME_SHAPES_OTHER_VALUES}))
    return [
        (["hf-to-mcore", "--input", str(tmp_path / "missing")], f"--input {tmp_path / 'missing'} does not exist"),
        (["mcore-to-hf", "--input", str(source_mcore), "--hf-config", str(tmp_path / "missing")],
         f"--hf-config {tmp_path / 'missing'} does not exist"),
        (["mcore-to-hf", "--input", str(source[0])], "not a megatron-dapo distributed checkpoint"),
        (["mcore-to-hf", "--input", str(source_mcore), "--hf-config", str(not_hf)], "no config.json"),
        (["mcore-to-hf", "--input", str(source_mcore), "--hf-config", str(other_values)],
         "not the model the checkpoint was saved from"),
        (["hf-to-mcore", "--input", str(not_hf)], "no config.json"),
        (["hf-to-mcore", "--input", str(source[0]), "--tp", "8"], "num_attention_heads"),
        (["hf-to-mcore", "--input", str(source[0]), "--ep", "2"], "is a dense model"),
        (["hf-to-mcore", "--input", str(source[0]), "--output", str(source_mcore)], "already holds a checkpoint"),
    ]


def test_every_user_mistake_is_one_error_line(source, source_mcore, tmp_path, capsys):
    from megatron_dapo.checkpoint.convert import main

    for args, says in _bad_inputs(source, source_mcore, tmp_path):
        argv = args if "--output" in args else [*args, "--output", str(tmp_path / "out")]
        assert main(argv) == 2, args
        assert says in _one_error_line(capsys.readouterr().err), args
        assert _nothing_written(tmp_path / "out")


def test_a_mapping_error_is_one_error_line(source, tmp_path, capsys):
    from megatron_dapo.checkpoint.convert import main

    bad = _with_unknown_tensor(source[0], tmp_path / "bad")
    assert main(["hf-to-mcore", "--input", str(bad), "--output", str(tmp_path / "out")]) == 2
    # MappingError is a KeyError, whose plain str() would wrap the message in quotes.
    assert _one_error_line(capsys.readouterr().err).startswith(
        f"error: {bad}: tensor 'model.layers.9.self_attn.q_proj.weight' is not part of a ")


def test_a_bug_is_still_a_traceback(source_mcore, tmp_path, monkeypatch):
    from megatron_dapo.checkpoint import convert

    def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(convert, "mcore_to_hf", broken)
    with pytest.raises(TypeError, match="a bug"):
        convert.main(["mcore-to-hf", "--input", str(source_mcore), "--output", str(tmp_path / "out")])
