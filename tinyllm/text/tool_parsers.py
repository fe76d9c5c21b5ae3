"""The names `--tool-call-parser` takes (vLLM's names; tinyllm.text.tool_formats says what
each is), apart so that the options' help does not load the grammars."""

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "openai")
