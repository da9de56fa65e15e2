"""A request's omitted sampling fields take the model's generation_config.json, else the server's.

Pure tables for the merge (`protocol.sampling`), the generation_config.json parser and the GGUF
import's generation_config; the sampler's min-p; what a node shows (`/v1/models`) and how it finds
a model's file by hash; then real runner processes, as a node starts them, on the random model
with a generation_config.json added: one that says temperature 0 answers a request without
sampling fields with the greedy text, and one that says how to sample gives the same seeded text
on one stage and on two (the entry runner decides every field and sends them to the last stage).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import mlx.core as mx
import pytest
import trio

from node.models.generation_config import read_sampling_defaults
from node.models.gguf_sampling import gguf_generation_config
from node.pipeline.shard import request_sampler
from node.runner.supervisor import RunnerSupervisor
from node.serving.model_sampling import ModelSampling
from protocol.chat import SamplingParams
from protocol.manifest import FileEntry, Manifest
from protocol.sampling import SERVER_DEFAULTS, Sampling, SamplingDefaults, model_defaults, resolve_sampling
from tests.nodes import RunningNode
from tests.stage_process import StageProcess
from tests.test_seeded_sampling import answer, request, second_stage_of, spec

pytestmark = pytest.mark.timeout(300)

SERVER = SERVER_DEFAULTS.model_dump()

RESOLVED = [
    ("nothing given: the server's", SamplingParams(), SamplingDefaults(), SERVER_DEFAULTS),
    (
        "the model's over the server's, field by field",
        SamplingParams(),
        SamplingDefaults(temperature=0.2, top_p=0.9),
        Sampling(**{**SERVER, "temperature": 0.2, "top_p": 0.9}),
    ),
    (
        "the request's over the model's",
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingDefaults(temperature=0.2, min_p=0.1, top_k=20),
        Sampling(**{**SERVER, "temperature": 1.0, "min_p": 0.2, "top_k": 20}),
    ),
    (
        "explicit zeros are given, not omitted",
        SamplingParams(temperature=0, top_k=0, min_p=0),
        SamplingDefaults(temperature=0.6, top_k=20, min_p=0.1),
        Sampling(**{**SERVER, "temperature": 0.0, "top_k": 0, "min_p": 0.0}),
    ),
    (
        "the seed and a repetition penalty pass through",
        SamplingParams(seed=7),
        SamplingDefaults(repetition_penalty=1.05),
        Sampling(**{**SERVER, "repetition_penalty": 1.05, "seed": 7}),
    ),
    (
        "the request's repetition penalty over the model's",
        SamplingParams(repetition_penalty=1.0),
        SamplingDefaults(repetition_penalty=1.3),
        SERVER_DEFAULTS,
    ),
]


@pytest.mark.parametrize(
    ("request_", "model", "expected"), [c[1:] for c in RESOLVED], ids=[c[0] for c in RESOLVED]
)
def test_resolve_sampling(request_: SamplingParams, model: SamplingDefaults, expected: Sampling) -> None:
    assert resolve_sampling(request_, model) == expected


PARSED = [
    ("empty", {}, SamplingDefaults()),
    ("token ids only", {"bos_token_id": 1, "eos_token_id": [2, 3]}, SamplingDefaults()),
    (
        "Qwen3's",
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2},
        SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20),
    ),
    (
        "do_sample false is greedy",
        {"do_sample": False, "temperature": 0.6},
        SamplingDefaults(temperature=0.0),
    ),
    ("temperature 0", {"temperature": 0}, SamplingDefaults(temperature=0.0)),
    (
        "min_p, penalty",
        {"min_p": 0, "repetition_penalty": 1.05},
        SamplingDefaults(min_p=0.0, repetition_penalty=1.05),
    ),
    (
        "invalid values say nothing",
        {"temperature": "hot", "top_p": 0, "top_k": -1, "min_p": 2, "repetition_penalty": math.nan},
        SamplingDefaults(),
    ),
    ("booleans and float k say nothing", {"temperature": True, "top_k": 40.0}, SamplingDefaults()),
]


@pytest.mark.parametrize(("config", "expected"), [c[1:] for c in PARSED], ids=[c[0] for c in PARSED])
def test_model_defaults_from_generation_config(config: dict[str, Any], expected: SamplingDefaults) -> None:
    assert model_defaults(config) == expected


BUILTIN_META = {
    "general.organization": "HuggingFaceTB",
    "general.basename": "smollm2",
    "general.size_label": "135M",
}
GGUF = [
    (
        "llama.cpp's keys, float32 values rounded",
        {
            "general.sampling.temp": 0.6000000238418579,
            "general.sampling.top_p": 0.949999988079071,
            "general.sampling.top_k": 20,
            "general.sampling.min_p": 0.0,
            "general.sampling.penalty_repeat": 1.0,
        },
        {
            "do_sample": True,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },
    ),
    ("greedy", {"general.sampling.temp": 0.0}, {"temperature": 0.0}),
    ("the built-in model", BUILTIN_META, {"do_sample": True, "temperature": 0.7, "top_p": 0.1}),
    ("its own keys win", {**BUILTIN_META, "general.sampling.top_k": 5}, {"do_sample": True, "top_k": 5}),
    ("another SmolLM2 size", {**BUILTIN_META, "general.size_label": "1.7B"}, None),
    ("nothing", {"general.basename": "llama", "general.sampling.temp": "hot"}, None),
]


@pytest.mark.parametrize(("meta", "expected"), [c[1:] for c in GGUF], ids=[c[0] for c in GGUF])
def test_gguf_generation_config(meta: dict[str, Any], expected: dict[str, Any] | None) -> None:
    config = gguf_generation_config(meta)
    assert config == expected
    if config is not None:
        assert list(config) == sorted(config)  # the file's bytes depend on the metadata only


def test_the_builtin_model_folder_has_its_defaults(builtin_model_dir: Path) -> None:
    assert read_sampling_defaults(builtin_model_dir) == SamplingDefaults(temperature=0.7, top_p=0.1)


@pytest.mark.parametrize("seed", [None, 3])
def test_min_p_draws_only_tokens_near_the_most_likely(seed: int | None) -> None:
    logprobs = mx.log(mx.softmax(3 * mx.random.normal((1, 64), key=mx.random.key(2))))
    probs = cast(list[float], mx.exp(logprobs)[0].tolist())
    near = {i for i, p in enumerate(probs) if p >= 0.3 * max(probs)}
    sampler = request_sampler(Sampling(temperature=5.0, top_p=1.0, top_k=0, min_p=0.3, seed=seed))
    drawn = {cast(int, sampler(logprobs).item()) for _ in range(80)}
    assert drawn <= near and len(drawn) > 1
    assert 1 < len(near) < 20  # the cut did cut


def test_a_node_finds_a_models_defaults_by_hash(tmp_path: Path) -> None:
    """A model whose entry runs elsewhere: its generation_config.json's hash in the manifest, the
    file in this node's data dir (under any name); none in the manifest: the server's defaults."""
    text = json.dumps({"temperature": 0.3}).encode()
    entry = FileEntry(path="generation_config.json", size=len(text), sha256=hashlib.sha256(text).hexdigest())
    weights = FileEntry(path="model.safetensors", size=1, sha256="0" * 64)
    with_config, without = Manifest(files=(entry, weights)), Manifest(files=(weights,))
    now = [0.0]
    sampling = ModelSampling(tmp_path, clock=lambda: now[0])
    assert sampling.defaults(without, None) == SamplingDefaults()
    assert sampling.defaults(with_config, None) is None  # not here (yet)
    held = tmp_path / "models" / "cluster" / "abc"
    held.mkdir(parents=True)
    (held / "generation_config.json").write_bytes(text)
    assert sampling.defaults(with_config, None) is None  # looked for again only after RETRY_S
    now[0] = 11.0
    assert sampling.defaults(with_config, None) == SamplingDefaults(temperature=0.3)
    (held / "generation_config.json").write_bytes(b'{"temperature": 0.9}')  # another file now
    assert sampling.defaults(with_config, None) == SamplingDefaults(temperature=0.3)  # by content


def test_v1_models_shows_the_effective_defaults(random_node: RunningNode) -> None:
    """The random model has no generation_config.json: the server's defaults, none from the model."""
    [card] = httpx.get(f"{random_node.base_url}/v1/models", timeout=30).json()["data"]
    assert card["sampling_defaults"] == {**SERVER_DEFAULTS.model_dump(exclude={"seed"}), "from_model": []}


# --- real runner processes ----------------------------------------------------------------------
PICKY = {"do_sample": True, "temperature": 0.9, "top_k": 5, "min_p": 0.1}
"""A model's sampling defaults unlike the server's (temperature 0.8, top-k 40, min-p 0.05)."""


def with_generation_config(source: Path, folder: Path, config: dict[str, Any]) -> Path:
    """The model in `source`, plus a generation_config.json, as a folder of links."""
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def greedy_model(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(
        random_model_dir, tmp_path_factory.mktemp("greedy") / "tiny", {"temperature": 0}
    )


@pytest.fixture(scope="module")
def picky_model(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(random_model_dir, tmp_path_factory.mktemp("picky") / "tiny", PICKY)


@pytest.fixture
def picky_second_stage(picky_model: Path) -> Iterator[StageProcess]:
    with second_stage_of(picky_model) as stage:
        yield stage


async def text_of(runner: RunnerSupervisor, rid: str, params: SamplingParams) -> str:
    return (await answer(runner.open_stream(request(rid, params))))[0]


def test_requests_without_sampling_fields_take_the_models_defaults(
    random_model_dir: Path, greedy_model: Path, picky_model: Path, picky_second_stage: StageProcess
) -> None:
    host, port = picky_second_stage.address
    plain, greedy = RunnerSupervisor(spec(random_model_dir)), RunnerSupervisor(spec(greedy_model))
    picky = RunnerSupervisor(spec(picky_model))
    picky_split = RunnerSupervisor(spec(picky_model, pipeline=(1, "127.0.0.1", (f"{host}:{port}",))))
    omitted = SamplingParams(seed=5, max_tokens=24)  # no sampling field: only the seed
    explicit_greedy = SamplingParams(temperature=0, max_tokens=24)

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            for runner in (plain, greedy, picky, picky_split):
                await nursery.start(runner.run)
            with trio.fail_after(240):
                greedy_text = await text_of(plain, "greedy", explicit_greedy)
                # The config's temperature 0: the greedy text, as an explicit temperature 0 gets.
                assert await text_of(greedy, "omitted", omitted) == greedy_text
                assert await text_of(greedy, "explicit", explicit_greedy) == greedy_text
                # Without a config: the server's defaults sample (the seed chose what).
                server_text = await text_of(plain, "omitted", omitted)
                assert server_text != greedy_text
                # A repetition penalty reaches the batch's logits: below 1 it favours the last 20
                # tokens (the random model's greedy text repeats none of them, so 2.0 changes nothing).
                penalized = SamplingParams(temperature=0, repetition_penalty=0.05, max_tokens=24)
                assert await text_of(plain, "penalized", penalized) != greedy_text
                # The picky config on one stage and on two: the same seeded text (the last stage
                # samples with the settings the entry runner decided), unlike the server's.
                picky_text = await text_of(picky, "omitted", omitted)
                assert await text_of(picky_split, "omitted-split", omitted) == picky_text
                assert picky_text not in (server_text, greedy_text)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
