"""Engines on an already loaded model, run until every request is done: shared by the tests
that compare outputs between engine settings."""

from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams


def engine_on(llm, **kw) -> LLMEngine:
    """A fresh engine (its own KV pool and settings) on `llm`'s weights and tokenizer."""
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_model_len", 2048)
    return LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(**kw))


def assert_settings_give_the_bits_alone(
    llm, batch: list[list[int]], params: SamplingParams, settings: dict[str, dict]
) -> None:
    """Each engine setting (EngineConfig fields, by a name for the message) gives every request
    of `batch`, run together, the tokens and logprobs it gets alone on a default engine."""
    alone = [run_all(engine_on(llm), [p], params)[0] for p in batch]
    for name, setting in settings.items():
        together = run_all(engine_on(llm, **setting), batch, params)
        for a, b in zip(alone, together, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
            assert b.outputs[0].logprobs == a.outputs[0].logprobs, name


def run_all(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
) -> list[RequestOutput]:
    """Each prompt's final output, in order; every block must be back in the pool after."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(None, sp, request_id=str(i), prompt_token_ids=p)
    done: dict[int, RequestOutput] = {}
    while engine.has_unfinished():
        done |= {int(o.request_id): o for o in engine.step() if o.finished}
    assert engine.kv.pool.num_used == 0, "a block was not given back"
    return [done[i] for i in range(len(prompts))]
