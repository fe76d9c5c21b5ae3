"""`tinyllm bench serve --workload multi-turn`: the chat replay of `tinyllm bench multi-turn`,
sent to a running OpenAI-compatible server.

The same conversations, turn lengths and answer lengths as the in-process replay, with one
difference the API forces: the OpenAI API streams an answer as text, never as token ids, so a
history that includes earlier answers can only be resent as text. Every turn is therefore a
/v1/completions request with a text prompt (no chat template: the prompt is the history
verbatim, as the in-process replay's is): the conversation so far, each earlier answer as the
server streamed it, then the turn's new message, separated by blank lines. A new message is the
workload's random token ids, each written as one of a few common words (one token each in most
vocabularies), so its length in tokens stays close to the in-process replay's.

A turn is sent when the previous turn's stream has ended; conversations start at once or as
Poisson arrivals at --request-rate, and --max-concurrency caps conversations in flight.
"""

import asyncio
import contextlib

from tqdm import tqdm

from tinyllm.entrypoints.bench.serve_client import Client
from tinyllm.entrypoints.bench.serve_report import Outcome
from tinyllm.entrypoints.workloads import Request

WORDS = (
    "the of and to in is was for on that with as it by at from his an were are which this be "
    "has had one all their there been if more when will would who so no other into time only "
    "new some could these two may first then do any like my now over such our man me even most"
).split()
TURN_SEPARATOR = "\n\n"


def message(turn: Request) -> str:
    """A turn's new message: its random ids, each as a word."""
    return " ".join(WORDS[i % len(WORDS)] for i in turn.prompt_token_ids)


def next_prompt(history: str, answer: str, turn: Request) -> str:
    """The prompt of a conversation's next turn: the previous prompt, its answer, the new
    message. The first turn's history is empty."""
    if not history:
        return message(turn)
    return history + answer + TURN_SEPARATOR + message(turn)


async def replay_chats(
    client: Client,
    chats: list[list[Request]],
    due_times: list[float],
    cap: asyncio.Semaphore | None,
    bar: tqdm,
) -> list[Outcome]:
    """Every conversation's turns in order, conversations concurrently; the outcomes in
    conversation order, turn after turn. After a failed turn its conversation stops: its later
    turns are recorded as failed, unsent."""

    async def converse(turns: list[Request], due: float) -> list[Outcome]:
        await asyncio.sleep(max(0.0, due - client.now()))
        outcomes: list[Outcome] = []
        prompt = ""
        # A conversation holds its slot between turns, as a chat user does.
        async with cap or contextlib.nullcontext():
            for k, turn in enumerate(turns):
                if outcomes and outcomes[-1].error is not None:
                    out = Outcome(0, turn.max_tokens, error=f"not sent: turn {k} failed")
                else:
                    prompt = next_prompt(prompt, outcomes[-1].text if outcomes else "", turn)
                    out = await client.send(prompt, turn.max_tokens, asyncio.Event())
                outcomes.append(out)
                bar.update()
        return outcomes

    tasks = [converse(t, due) for t, due in zip(chats, due_times, strict=True)]
    return [out for outcomes in await asyncio.gather(*tasks) for out in outcomes]
