"""The offline Python API: `LLM(model).generate(prompts, params)`, as vLLM users know it."""

import dataclasses
import json
import logging
import time

import torch
from tqdm import tqdm

from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.engine.worker.tp_worker import start_workers
from tinyllm.entrypoints.generation_config import default_sampling
from tinyllm.entrypoints.llm_options import llm_configs
from tinyllm.entrypoints.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    pairs,
    plan_scores,
    pooled,
)
from tinyllm.host.threads import rank_threads, set_threads, warn_if_oversubscribed
from tinyllm.loaders.load_config import LoadConfig
from tinyllm.loaders.model_loader import load_model
from tinyllm.model.config import ModelLoadError
from tinyllm.model.tensor_parallel import apply_tp
from tinyllm.text import harmony
from tinyllm.text.answer import parse_answer
from tinyllm.text.reasoning import (
    HARMONY,
    ThinkSplit,
    reasoning_format,
    template_kwargs,
    thinking_state,
)
from tinyllm.text.reasoning_grammar import harmony_grammar, thinking_grammar
from tinyllm.text.tool_calls import parse_tool_calls
from tinyllm.text.tool_formats import tool_format
from tinyllm.text.tool_grammar import tool_choice_grammar

log = logging.getLogger("tinyllm")

_PROMPTS_ARE = "prompts: give a text, a list of token ids, or a list of those"


def resolve_device(device: str | None) -> torch.device:
    """cuda when torch sees a GPU, else cpu; a device this torch cannot use is an error that
    says so before anything loads."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"unknown device {device!r}: use cpu or cuda (cuda:N for one GPU)"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: tinyllm runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
        )
        raise ValueError(f"device {device!r}: {why}; use cpu")
    return dev


class LLM:
    def __init__(
        self,
        model: str | None = LoadConfig.model,
        dtype: str | torch.dtype | None = LoadConfig.dtype,
        **options: object,
    ):
        """Every option by name: the fields of LoadConfig, LLMOptions and EngineConfig
        (tinyllm/entrypoints/llm_options.py), whose help says what each does.
        `threads`: torch's CPU threads (None: torch's own choice, OMP_NUM_THREADS if set;
        under tensor parallelism, each rank's: None gives each rank its share of the cores).
        `generation_config`: "auto" for the model's recommended sampling defaults (see
        get_default_sampling_params), "vllm" for SamplingParams' neutral ones.
        `load_format`: "dummy" builds `model` (a config.json, or a name from
        tinyllm.loaders.dummy.named_configs()) with random weights, int4 unless `quantization`
        says otherwise, and no tokenizer: for benchmarks of real shapes without downloads."""
        # Bad options fail here, before anything loads.
        own, load_config, engine_config = llm_configs(dict(model=model, dtype=dtype, **options))
        dev = resolve_device(own.device)
        threads, tp = own.threads, engine_config.tensor_parallel_size
        if tp > 1 and threads is None:
            threads = rank_threads(tp)
        if threads is not None:
            set_threads(threads)
        if dev.type == "cpu":
            warn_if_oversubscribed(torch.get_num_threads())
        # Rank 0's part first: a model that does not split fails here, before any worker.
        loaded = load_model(load_config, dev, 0, tp)
        self.model_name = loaded.name
        self.model_path = loaded.path  # the weights: a file, or a directory of them
        self.tokenizer = loaded.tokenizer
        # How tool calls are written: the chat template's format unless tool_call_parser names one.
        self.tool_format = tool_format(own.tool_call_parser, self.tokenizer.chat_template)
        # A thinking model's format (None: it does not think), and its thinking budget.
        self.reasoning = reasoning_format(own.reasoning_parser, loaded.tokenizer.chat_template)
        if self.tool_format.name == "openai":  # harmony's calls are parsed with its channels
            self.reasoning = HARMONY
        self.reasoning_budget = own.reasoning_budget
        self.default_sampling = default_sampling(own.generation_config, loaded.path, loaded.reader)
        try:
            self.get_default_sampling_params()
        except ValueError as e:
            raise ModelLoadError(
                f"{loaded.path}: its recommended sampling settings are invalid ({e}); "
                "use generation_config='vllm' (--generation-config vllm)"
            ) from None
        workers = None
        if tp > 1:  # the other ranks, each loading its own part
            workers = start_workers(tp, dev, load_config, threads)
            apply_tp(loaded.model)
        try:
            self.engine = LLMEngine(loaded.model, loaded.tokenizer, engine_config, workers)
        except BaseException:
            if workers is not None:
                workers.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; also done at exit."""
        self.engine.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no SamplingParams: the model's recommended
        settings under generation_config="auto" (tinyllm.entrypoints.generation_config says
        which). To change one field and keep the rest:
        `dataclasses.replace(llm.get_default_sampling_params(), temperature=0.7)`."""
        return SamplingParams(**self.default_sampling)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block (vLLM's name); how many were cached."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        return self._submit(self._encode(prompts), params, use_tqdm)

    def embed(
        self,
        prompts: str | list[int] | list[str | list[int]],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's LLM.embed), on a pooling model (an embedding model,
        or any model with the `pooling` option); `pooling_params` for Matryoshka `dimensions`
        and `normalize`. Text prompts get the model's prompt named `prompt_name` before them, or
        `prompt`, or its default prompt, as sentence-transformers' encode does."""
        params = pooling_params or PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        spec = self.engine.pooling
        encoded = self._encode(prompts, spec.prompt(prompt_name, prompt) if spec else "")
        outputs = self._submit(encoded, [params] * len(encoded), use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(v.tolist()))
            for o, v in ((o, pooled(o)) for o in outputs)
        ]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        instruction: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """How relevant each text of `data_2` is to `data_1` (one text against each, or two
        lists pairwise), as vLLM's LLM.score: a reranker's probability (a cross-encoder, or a
        decoder with `classifier_from_token`, whose prompt is Qwen3-Reranker's with
        `instruction`), or an embedding model's cosine similarity."""
        spec = self.engine.pooling
        if spec is None:
            raise ValueError("this model generates text; it does not embed or score")
        texts = pairs(data_1, data_2)
        plan = plan_scores(self.tokenizer, spec, texts, instruction, truncate_prompt_tokens)
        outputs = self._submit(plan.prompts, [plan.params] * len(plan.prompts), use_tqdm)
        scores = plan.scores([pooled(o) for o in outputs])
        owners = outputs  # each score's request: the pair's, or (embeddings) the document's
        if plan.embedded_pairs is not None:
            owners = [outputs[b] for _, b in plan.embedded_pairs]
        return [
            ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(score))
            for o, score in zip(owners, scores, strict=True)
        ]

    def _encode(
        self, prompts: str | list[int] | list[str | list[int]], prefix: str = ""
    ) -> list[tuple[str | None, list[int]]]:
        """Prompts as (text, token ids): a text (after `prefix`), a list of token ids, or a
        list of those."""
        if not isinstance(prompts, str | list | tuple):
            raise ValueError(_PROMPTS_ARE + f", not {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text, or token ids (each checked when added)
        bad = [p for p in prompts if not isinstance(p, str | list | tuple)]
        if bad or not prompts:
            raise ValueError(_PROMPTS_ARE + (f", not {type(bad[0]).__name__}" if bad else ""))
        return [
            (prefix + p, self.tokenizer.encode(prefix + p))
            if isinstance(p, str)
            else (None, list(p))
            for p in prompts
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict = "auto",
        parallel_tool_calls: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.

        `chat_template_kwargs`: more variables for the template, as vLLM takes them (Qwen3's
        {"enable_thinking": False}). On a thinking model (the `reasoning_parser` option) each
        completion's `text` is the answer alone and its `reasoning` the thinking (vLLM's offline
        chat returns both in `text`; tinyllm keeps them apart, as its server does); `token_ids`
        are all the tokens. A constraint (tools, structured_outputs) and the `reasoning_budget`
        apply from the end of the thinking on.

        `tools` and `tool_choice` as OpenAI's API takes them ("none", "auto", "required" or
        {"type": "function", "function": {"name": ...}}): the tools go into the prompt, the
        answer is constrained to well-formed calls in the model's format (`self.tool_format`,
        tinyllm.text.tool_formats) and each completion's `tool_calls` holds the calls parsed
        from its `text`. One call per answer unless `parallel_tool_calls` (a small model allowed
        more tends to repeat its call). A SamplingParams' JSON schema (or json_object)
        structured output with tools: the answer is either calls or that JSON."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("no conversation given: pass a list of messages")
        kwargs = template_kwargs(self.tokenizer.chat_template, None, chat_template_kwargs)
        encoded = [
            self.tokenizer.encode_chat(
                c, tools=tools, tool_format=self.tool_format, template_kwargs=kwargs
            )
            for c in conversations
        ]
        if not tools:
            return self._submit_chat(encoded, params, use_tqdm)
        if not isinstance(params, list):
            params = [params or self.get_default_sampling_params()] * len(encoded)
        grammars: dict[str, StructuredOutputsParams] = {}

        def with_tools(p: SamplingParams) -> SamplingParams:
            own = p.structured_outputs
            answer = None
            if own is not None and tool_choice != "none":
                answer = {"type": "object"} if own.json_object else own.json
                if isinstance(answer, str):
                    answer = json.loads(answer)
                if answer is None:
                    raise ValueError(
                        "SamplingParams.structured_outputs with tools: only json or json_object "
                        "combines with calls; use tool_choice='none' or drop one"
                    )
            key = json.dumps(answer)
            if key not in grammars:
                grammar = tool_choice_grammar(
                    tools,
                    tool_choice,
                    parallel_tool_calls,
                    self.tool_format,
                    answer,
                    self.tokenizer.added_tokens,
                )
                grammars[key] = StructuredOutputsParams(grammar=grammar)
            if own is not None and tool_choice == "none":  # the tools are only for the model
                return p
            return dataclasses.replace(p, structured_outputs=grammars[key])

        calls = tool_choice != "none"
        params = [with_tools(p) for p in params]
        tool_grammars = {g.grammar for g in grammars.values()}
        outputs = self._submit_chat(encoded, params, use_tqdm, tool_grammars, calls)
        if calls and not (self.reasoning and self.reasoning.harmony):  # else split out already
            for completion in (c for out in outputs for c in out.outputs):
                cut = completion.finish_reason == "length"
                parsed = parse_tool_calls(completion.text, cut=cut, scan=self.tool_format.scan)
                completion.tool_calls = parsed.calls
        return outputs

    def _submit_chat(
        self,
        prompts: list[tuple[str, list[int]]],
        params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
        tool_grammars: set[str | None] | None = None,
        calls: bool = False,
    ) -> list[RequestOutput]:
        """_submit for chat prompts: on a thinking model, each prompt's constraint and the
        thinking budget apply after the thinking, and each answer's thinking moves from `text`
        to `reasoning`. `tool_grammars`: the constraints that are tool grammars; `calls`: a
        harmony answer's calls go to `tool_calls` (split out here with its reasoning)."""
        fmt = self.reasoning
        if fmt is None or (isinstance(params, list) and len(params) != len(prompts)):
            return self._submit(prompts, params, use_tqdm)  # (which refuses a length mismatch)
        if isinstance(params, list):
            params = list(params)  # the caller's list stays as given
        else:
            params = [params or self.get_default_sampling_params()] * len(prompts)
        states = [thinking_state(fmt, text) for text, _ in prompts]
        budget = self.reasoning_budget
        for i, (p, state) in enumerate(zip(params, states, strict=True)):
            if fmt.harmony:  # its markers kept in the text for the split, as the server does
                p = params[i] = harmony.keep_markers(p, self.tokenizer.token_to_id)
            so = p.structured_outputs
            if state != "closed" and (so is not None or budget is not None):
                answer = (
                    None
                    if so is None
                    else {k: v for k, v in dataclasses.asdict(so).items() if v not in (None, False)}
                )
                if fmt.harmony:  # a tool grammar writes whole messages, others a final one's body
                    messages = so is not None and so.grammar in (tool_grammars or ())
                    grammar = harmony_grammar(self.tokenizer, False, answer, budget, messages)
                else:
                    grammar = thinking_grammar(self.tokenizer, fmt, state, answer, budget)
                so = StructuredOutputsParams(grammar=grammar)
                params[i] = dataclasses.replace(p, structured_outputs=so)
        outputs = self._submit(prompts, params, use_tqdm)
        for out, state in zip(outputs, states, strict=True):
            for completion in out.outputs:
                split = harmony.HarmonySplit() if fmt.harmony else ThinkSplit(fmt, state)
                answer = parse_answer(completion.text, split)
                completion.reasoning, completion.text = answer.reasoning, answer.content
                if calls and isinstance(split, harmony.HarmonySplit):
                    for call, whole in zip(answer.calls, split.complete, strict=True):
                        call.complete = whole
                    completion.tool_calls = answer.calls
        return outputs

    def _submit(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams | list[SamplingParams | PoolingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params or self.get_default_sampling_params()] * len(prompts)
        engine = self.engine
        ids: list[str] = []
        try:  # whatever goes wrong (a bad prompt, Ctrl-C), nothing of this call stays queued
            for (text, token_ids), p in zip(prompts, params, strict=True):
                final = (
                    p
                    if isinstance(p, PoolingParams)
                    else dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                )
                ids.append(engine.add_request(text, final, None, token_ids))
            done = self._run(len(ids), use_tqdm)
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return [done[r] for r in ids]

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="requests", unit="req", disable=not use_tqdm)
        start, tokens0 = time.perf_counter(), self.engine.stats().generation_tokens
        for outputs in self.engine.outputs():
            for out in outputs:
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            rate = (self.engine.stats().generation_tokens - tokens0) / (time.perf_counter() - start)
            # Redrawn at tqdm's own pace (update(0) waits its mininterval), not every step:
            # a redraw a step costs a single stream a few percent.
            bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
            bar.update(0)
        bar.close()
        return done
