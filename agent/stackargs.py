"""`py-spy dump --locals`, cut down to what a hang diagnosis needs and nothing it must not keep.

Gloo records no send/recv in FR, so which peer a blocked rank waits on is
only in its stack: the `src`/`dst` argument of torch.distributed's p2p call.
py-spy prints every frame's arguments and locals, which can hold anything a
training script keeps (paths, tokens, sample text), so only this survives:
each thread's header (its id, idle/active, name), every frame line, and,
in torch.distributed frames only, the peer arguments whose value is an
integer or None. The result is still py-spy's own format.
"""

from __future__ import annotations

from typing import Final

from hangwatch.stacktext import (
    PYSPY_ARG,
    PYSPY_FRAME,
    PYSPY_SECTION,
    THREAD_HEADERS,
    TORCH_DIST,
)

# torch.distributed's p2p signatures: send(tensor, dst, group, tag, group_dst),
# recv(tensor, src, group, tag, group_src), isend/irecv alike, P2POp(op, tensor, peer, ...).
PEER_ARGS: Final = frozenset({"src", "dst", "group_src", "group_dst", "peer", "tag", "group"})


def keep_peer_args(dump: str) -> str:
    """The py-spy `--locals` dump with thread headers, frames and p2p peer arguments only."""
    out: list[str] = []
    in_dist_frame = False
    section = ""
    header = False  # the frame's "Arguments:" line is written with its first kept argument
    for line in dump.splitlines():
        if line.startswith(THREAD_HEADERS):
            out.append(line.rstrip())
            in_dist_frame = False
        elif f := PYSPY_FRAME.match(line):
            out.append(line.rstrip())
            in_dist_frame = TORCH_DIST in f["file"].replace("\\", "/")
            section = ""
        elif m := PYSPY_SECTION.match(line):
            section = m["section"]
            header = True
        elif (
            in_dist_frame
            and section == "Arguments"
            and (a := PYSPY_ARG.match(line))
            and a["name"] in PEER_ARGS
            and (a["name"] != "group" or a["value"] == "None")
        ):
            if header:
                out.append("        Arguments:")
                header = False
            out.append(line.rstrip())
    return "\n".join(out) + "\n" if out else ""
