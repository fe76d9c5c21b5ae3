"""The `grounded` workload's tasks: edit, extract and quote requests over text that ships with
Python itself, the standard library's source and docstrings.

These are what people do with a local model (rename a variable, strip a function down, copy
out lines, quote documentation), and the answer copies long runs of its prompt: the case
speculative decoding by prompt lookup is for. Every task is a chat conversation (one user
message); the same seed gives the same conversations on the same Python version (the text is
the standard library's own, so another version's can differ).
"""

import importlib
import inspect
import random
import re
import textwrap

# Functions short enough that a rewrite of the whole function fits the workload's output cap.
FUNCTIONS = (
    "textwrap.indent",
    "textwrap.shorten",
    "shlex.quote",
    "string.capwords",
    "base64.b64encode",
    "colorsys.rgb_to_hsv",
    "colorsys.rgb_to_hls",
    "statistics.median",
    "statistics.median_low",
    "statistics.stdev",
    "shutil.copyfileobj",
    "html.escape",
    "urllib.parse.urldefrag",
    "zipfile.is_zipfile",
    "fnmatch.filter",
    "fnmatch.fnmatch",
    "random.Random.choice",
    "secrets.token_hex",
    "email.utils.quote",
    "mimetypes.guess_type",
    "logging.Logger.log",
    "threading.Event.wait",
    "dataclasses.asdict",
)
# Docstrings of several sentences, to quote from.
DOCSTRINGS = (
    "json.dump",
    "json.loads",
    "difflib.get_close_matches",
    "statistics.variance",
    "statistics.quantiles",
    "shutil.move",
    "mimetypes.guess_type",
    "threading.Event.wait",
    "queue.Queue.put",
    "tokenize.detect_encoding",
    "textwrap.dedent",
    "tempfile.mkdtemp",
)
NEW_NAMES = ("value", "item", "source", "target", "count", "text", "data", "entry")
KINDS = ("rename", "strip", "quote", "extract")


def resolve(dotted: str) -> object:
    """`module.attr.attr` -> the object, importing the longest importable module prefix."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"no module in {dotted!r}")


def _code(source: str) -> str:
    return f"```python\n{source.rstrip()}\n```"


def _rename(rng: random.Random, name: str, source: str) -> str:
    params = inspect.signature(resolve(name)).parameters
    names = sorted(
        p for p in params if p not in ("self", "cls") and len(re.findall(rf"\b{p}\b", source)) > 1
    )
    old = rng.choice(names)
    new = rng.choice([n for n in NEW_NAMES if not re.search(rf"\b{n}\b", source)])
    return (
        f"Rewrite this function with the variable `{old}` renamed to `{new}`, everywhere it "
        f"appears. Keep everything else as it is and reply with the whole function.\n\n"
        f"{_code(source)}"
    )


def _strip(rng: random.Random, name: str, source: str) -> str:
    return (
        "Rewrite this function without its docstring and without comments; keep the code "
        f"exactly as it is. Reply with the code only.\n\n{_code(source)}"
    )


def _extract(rng: random.Random, name: str, source: str) -> str:
    words = sorted({w for w in ("return", "if", "for", "raise", "=") if f" {w} " in source})
    word = rng.choice(words)
    return (
        f"Copy every line of this function that contains `{word}`, exactly as written, one "
        f"per line.\n\n{_code(source)}"
    )


def _sentences(doc: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?:])\s+", " ".join(doc.split())) if s]


def _quote(rng: random.Random, name: str) -> str:
    doc = inspect.getdoc(resolve(name))
    sentences = _sentences(doc)
    # A word that only one sentence has, so that the quote asked for is unambiguous.
    words = [
        w
        for w in sorted({w for s in sentences for w in re.findall(r"[a-z]{6,}", s)})
        if sum(bool(re.search(rf"\b{w}\b", s)) for s in sentences) == 1
    ]
    word = rng.choice(words)
    return (
        f"Here is the documentation of Python's `{name}`:\n\n{doc}\n\n"
        f"Quote, word for word, the sentence of it that mentions `{word}`."
    )


def grounded_conversations(seed: int, num_requests: int) -> list[list[dict[str, str]]]:
    """`num_requests` chat conversations, the task kinds in turn (rename, strip, quote,
    extract), each over a function or docstring drawn by `random.Random(seed)`; the first n of
    a longer list are the n of a shorter one."""
    rng = random.Random(seed)
    conversations = []
    for i in range(num_requests):
        kind = KINDS[i % len(KINDS)]
        if kind == "quote":
            content = _quote(rng, rng.choice(DOCSTRINGS))
        else:
            name = rng.choice(FUNCTIONS)
            source = inspect.getsource(resolve(name))
            task = {"rename": _rename, "strip": _strip, "extract": _extract}[kind]
            content = task(rng, name, textwrap.dedent(source))
        conversations.append([{"role": "user", "content": content}])
    return conversations
