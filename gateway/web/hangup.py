"""Hang-up hooks: the moment the server learns that a client's connection is gone, what a response
registered runs, inside the protocol's ``connection_lost`` callback, before any task is woken.

ASGI reports a lost connection as an ``http.disconnect`` message to whoever awaits ``receive()``;
on a loaded event loop that is several loop iterations late (the protocol sets an event, the
waiting task wakes on a later iteration and cancels the streaming task, which wakes on yet another
one), and each iteration of a loop serving hundreds of streams is long. ``tiergate serve``'s HTTP
protocol (gateway.web.serving) offers a list of callbacks in each request's scope
(``offer``) and runs them when the connection is lost mid-response (``hang_up``); a streamed
answer registers one that cancels its task at once (``on_hangup``), so the upstream call is
stopped on the next iteration. Under a server without the hook (tests' ASGI transports, another
server) ``on_hangup`` returns False and the response watches ``receive()`` as before.

Imports nothing of the web framework: plain scope dicts and callables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

log = logging.getLogger("tiergate.serving")
HANGUP_KEY = "tiergate.hangup"


def offer(scope: MutableMapping[str, Any]) -> None:
    """The server reports this request's hang-up through ``hang_up`` (a fresh list per request)."""
    scope[HANGUP_KEY] = []


def on_hangup(scope: MutableMapping[str, Any], callback: Callable[[], None]) -> bool:
    """Run ``callback`` (synchronously, in the server's callback) when the client's connection is
    lost before the response completed; False when the server offers no such report."""
    hooks = scope.get(HANGUP_KEY)
    if hooks is None:
        return False
    hooks.append(callback)
    return True


def hang_up(scope: MutableMapping[str, Any]) -> None:
    """The client's connection is gone mid-response: run (once) what the response registered."""
    for callback in scope.pop(HANGUP_KEY, None) or ():
        try:
            callback()
        except Exception as err:  # one hook's failure must not keep the others from running
            log.warning("a hang-up hook failed: %s", type(err).__name__)
