"""The scan shared by formats whose calls are JSON objects one after another once the calls
begin (Llama's `{"name": ..., "parameters": ...}`, Mistral v3's `[TOOL_CALLS][{...}, {...}]`):
a call ends where its object closes."""

from tinyllm.text.tool_calls import _DONE, _WHITESPACE, AnswerScan, _CallScan


class JsonCallsScan(AnswerScan):
    arguments_key = "arguments"
    between = ","  # what may stand between two calls, beside whitespace

    def __init__(self) -> None:
        super().__init__()
        self.next = -1  # where reading goes on, once the calls have begun
        self.done = False  # the calls are over (or never begin)

    def begin(self) -> int | None:
        """Where the first call may start, once the text shows the calls begin (setting
        `trigger_at`); None while it does not (or `done` if they never will)."""
        raise NotImplementedError

    def extend(self, delta: str) -> None:
        self.text += delta
        if self.next < 0:
            found = self.begin()
            if found is None:
                return
            self.next = found
        text = self.text
        while not self.done:
            if self.calls and self.calls[-1].stop < 0:
                call = self.calls[-1]
                call.scan(text, len(text))
                if call.closed is None:
                    self.done = call.expect == _DONE  # not a call object: no more calls
                    return
                call.stop = self.next = call.closed
                continue
            i = self.next
            while i < len(text) and (text[i] in _WHITESPACE or text[i] in self.between):
                i += 1
            self.next = i
            if i == len(text):
                return
            if text[i] == "{":
                self.calls.append(_CallScan(i, self.arguments_key))
            else:
                self.done = True
