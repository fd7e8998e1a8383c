"""A scripted OpenAI-compatible chat server on 127.0.0.1 for driving real ``tau2 run`` (tests, demo).

No language model can solve tau2 tasks on this machine, so this server plays both sides of a
tau2 conversation from a script, and misbehaves on purpose where told to. It speaks the
``/v1/chat/completions`` subset that litellm's ``openai/<model>`` provider sends and reads.

Who is asking: tau2 26.3's agent prompt (``tau2/agent/llm_agent.py``, ``SYSTEM_PROMPT`` with
``AGENT_INSTRUCTION`` "You are a customer service agent ...") versus the user simulator's
(``tau2/user/user_simulator.py``, ``SYSTEM_PROMPT`` with the task's ``<scenario>``; its history is
role-flipped by ``tau2/user/base.py`` ``flip_roles``). The user side recognises its task by a
snippet of the scenario and introduces itself with a tag ``<qg>TAG</qg>``; the agent side reads the
tag and acts out the mode the script gives that task for the requested model:

- ``solve``: call the task's expected tools (its ``evaluation_criteria.actions``) one by one, then
  say ``[done]`` with the information the task wants communicated; the user then performs its own
  expected tool calls (telecom) and stops with ``###STOP###`` (``tau2/user/base.py`` ``STOP``).
- ``wrong``: say ``[done]`` without doing anything (a plain task failure).
- ``toolerror``: keep calling a real tool with invalid arguments (tau2 ends it ``too_many_errors``).
- ``malformed``: a tool call whose arguments are not JSON (tau2's ``utils/llm_utils.py`` ``generate``
  runs ``json.loads`` on them and raises ``JSONDecodeError``).
- ``overflow``: HTTP 400 with vLLM's context-length message, which litellm 1.x maps to
  ``ContextWindowExceededError`` (``litellm_core_utils/exception_mapping_utils.py``, the
  "this model's maximum context length is" marker).
- ``drop``: close the connection without an answer (litellm raises ``APIConnectionError``).
- ``drop_once``: ``drop`` on the task's first agent request, then ``solve`` (a transient failure).

Run: ``python -m tests.evals.scripted_server SCRIPT.json PORT`` (SCRIPT: ``{"tasks": {TAG: {"key",
"agent_actions", "user_actions", "say"}}, "modes": {MODEL: {TAG: MODE}}}``); it prints ``ready``.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STOP = "###STOP###"
OVERFLOW = ("This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
            "in the messages, Please reduce the length of the messages.")
_ids = itertools.count()


def _tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{next(_ids)}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _is_tool_call(m: dict) -> bool:
    return m.get("role") == "assistant" and bool(m.get("tool_calls"))


def _text(m: dict) -> str:
    content = m.get("content")
    return content if isinstance(content, str) else json.dumps(content)


class Script:
    def __init__(self, script: dict):
        self.tasks, self.modes = script["tasks"], script.get("modes", {})
        self.requests: list[dict] = []  # (model, side, tag, mode), for tests to inspect
        self.lock = threading.Lock()

    def reply(self, body: dict) -> tuple[str, dict | list | None]:
        """``("message", {content, tool_calls})``, ``("error", body)`` or ``("drop", None)``."""
        messages = body.get("messages", [])
        system = "\n".join(_text(m) for m in messages if m.get("role") == "system")
        turns = [m for m in messages if m.get("role") != "system"]
        if "customer service agent" in system:
            return self._agent(body.get("model", ""), turns)
        return self._user(system, turns)

    def _log(self, **entry) -> None:
        with self.lock:
            self.requests.append(entry)

    def _user(self, system: str, turns: list[dict]) -> tuple[str, dict]:
        matches = [t for t, spec in self.tasks.items() if spec["key"] in system]
        tag = max(matches, key=lambda t: len(self.tasks[t]["key"]), default=None)  # the most specific
        self._log(side="user", tag=tag)
        said = [m for m in turns if m.get("role") == "assistant" and not _is_tool_call(m)]
        if tag is None:
            return "message", {"content": STOP}
        if not said:
            return "message", {"content": f"Hello, I need help with my account. <qg>{tag}</qg>"}
        if any("[done]" in _text(m) for m in turns if m.get("role") == "user"):
            actions = self.tasks[tag].get("user_actions", [])
            done = sum(_is_tool_call(m) for m in turns)
            if done < len(actions):
                a = actions[done]
                return "message", {"content": None, "tool_calls": [_tool_call(a["name"], json.dumps(a["arguments"]))]}
        return "message", {"content": f"Thank you, that is all. {STOP}"}

    def _agent(self, model: str, turns: list[dict]) -> tuple[str, dict | None]:
        found = re.search(r"<qg>(.+?)</qg>", " ".join(_text(m) for m in turns if m.get("role") == "user"))
        tag = found.group(1) if found else None
        mode = self.modes.get(model, {}).get(tag, "solve") if tag else "wrong"
        self._log(side="agent", model=model, tag=tag, mode=mode)
        spec = self.tasks.get(tag, {})
        if mode == "drop_once":
            with self.lock:
                self.modes[model][tag] = "solve"
            return "drop", None
        if mode == "drop":
            return "drop", None
        if mode == "overflow":
            return "error", {"object": "error", "message": OVERFLOW, "type": "BadRequestError", "param": None,
                             "code": 400}
        if mode == "malformed":
            return "message", {"content": None, "tool_calls": [_tool_call("get_user_details", '{"user_id": ')]}
        if mode == "toolerror":
            name = (spec.get("agent_actions") or [{"name": "get_user_details"}])[0]["name"]
            return "message", {"content": None, "tool_calls": [_tool_call(name, json.dumps({"no_such_argument": 1}))]}
        actions = spec.get("agent_actions", []) if mode == "solve" else []
        done = sum(_is_tool_call(m) for m in turns)
        if done < len(actions):
            a = actions[done]
            return "message", {"content": None, "tool_calls": [_tool_call(a["name"], json.dumps(a["arguments"]))]}
        say = " ".join(str(s) for s in spec.get("say", [])) if mode == "solve" else ""
        return "message", {"content": f"[done] Your request is handled. {say}".strip()}


def make_handler(script: Script):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self.path.endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            kind, payload = script.reply(body)
            if kind == "drop":
                self.close_connection = True
                self.connection.close()
                return None
            if kind == "error":
                return self._send(400, payload)
            message = {"role": "assistant", "content": payload.get("content"), "tool_calls": payload.get("tool_calls")}
            return self._send(200, {
                "id": f"chatcmpl-{next(_ids)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if payload.get("tool_calls") else "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})

        def do_GET(self):
            if self.path.endswith("/models"):
                return self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in script.modes]})
            return self._send(404, {"error": {"message": f"no route {self.path}"}})

    return Handler


def serve(script: dict, port: int = 0) -> tuple[ThreadingHTTPServer, Script]:
    """Start in a daemon thread; returns the server (``server_address[1]`` is the port) and its script."""
    state = Script(script)
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state


def script_for(domain_tasks: dict[str, list], modes: dict[str, dict[str, str]]) -> dict:
    """A script for tau2 ``Task`` objects (``{domain: [Task, ...]}``): tags ``<domain>/<task id>``,
    the key a scenario snippet unique to the task, actions and communicated info from the task's
    own evaluation criteria."""
    tasks = {}
    for domain, items in domain_tasks.items():
        for task in items:
            criteria = task.evaluation_criteria
            actions = list(criteria.actions or []) if criteria else []
            tasks[f"{domain}/{task.id}"] = {
                "key": str(task.user_scenario),
                "agent_actions": [{"name": a.name, "arguments": a.arguments} for a in actions
                                  if a.requestor == "assistant"],
                "user_actions": [{"name": a.name, "arguments": a.arguments} for a in actions if a.requestor == "user"],
                "say": list(criteria.communicate_info or []) if criteria else []}
    return {"tasks": tasks, "modes": modes}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        server, _ = serve(json.load(f), int(sys.argv[2]))
    print("ready", server.server_address[1], flush=True)
    threading.Event().wait()
