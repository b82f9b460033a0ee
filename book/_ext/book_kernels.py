"""The kernels the book build starts: no lost replies, no warning at start.

Lost replies. myst-nb executes each chapter through nbclient, whose async kernel
client waits for a message with ``await socket.poll(timeout)`` (jupyter_client's
``AsyncZMQSocketChannel.get_msg``).  pyzmq's asyncio sockets learn of incoming
messages from the socket's file descriptor, which ZeroMQ signals
*edge*-triggered: any other operation on the socket re-reads ZMQ_EVENTS and
consumes the edge.  pyzmq re-arms its own pending receives after a send made
through the asyncio socket, but jupyter_client's ``Session.send`` writes to a
synchronous shadow of the socket, behind pyzmq's back.  A cell with an
``interact`` makes nbclient send a ``comm_msg`` (the Output widget's new state)
on the shell socket while it waits on that socket for the cell's
``execute_reply``; when the reply lands just before that send, the wait sees no
edge and sleeps until its timeout (300 s in ``_config.yml``), then finds the
reply and goes on as if nothing happened.  That is the stall of issue 27 (one
run of chapter 4 in 25-45 in ``tools/kernel_stress.py``; the same bug as
jupyter/nbclient#312).  The channels below send through the asyncio socket and
wait on a receive future, which pyzmq re-checks after each such send, so no
edge can be lost (``tests/test_book_kernels.py`` stages the race).
``configure_kernel_manager`` makes them the default for the kernels this
process starts.

No warning at start. ipykernel 7 warns on the terminal at every start ("Kernel
is running over TCP without encryption") unless the kernel manager provisions
CurveZMQ keys, which jupyter_client does with ``transport_encryption = "auto"``
for kernelspecs that declare support (ipykernel's does).  myst-nb creates its
kernel managers without a config object, so we set that option's default.

Controls that work on the static page. The kernels run with
``SEQLIB_STATIC_CONTROLS=1``, so ``seqlib.notebook.interact`` shows a player over
precomputed outputs where Jupyter shows live widgets (see its docstring).
"""

from __future__ import annotations

import asyncio
import os
from queue import Empty

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager, KernelManager
from traitlets import Type

from seqlib.notebook import STATIC_CONTROLS_ENV


class ReceivingChannel(AsyncZMQSocketChannel):
    """An async channel that sends and receives through pyzmq's asyncio socket, so neither hides from the other."""

    def send(self, msg: dict) -> None:
        assert self.socket is not None
        # the frames Session.send writes, without its synchronous shadow of the socket
        self.socket.send_multipart([*self.session.serialize(msg), *msg.get("buffers", [])])

    async def get_msg(self, timeout: float | None = None) -> dict:
        assert self.socket is not None
        frames = self.socket.recv_multipart()  # done at once when a message is queued
        done, _ = await asyncio.wait({frames}, timeout=timeout)
        # cancel() fails only when the frames arrived meanwhile: then they are ours to return
        if not done and frames.cancel():
            raise Empty
        _, message = self.session.feed_identities(frames.result())
        return self.session.deserialize(message)


class BookKernelClient(AsyncKernelClient):
    """nbclient's kernel client with :class:`ReceivingChannel` on every socket channel."""

    shell_channel_class = Type(ReceivingChannel)
    iopub_channel_class = Type(ReceivingChannel)
    stdin_channel_class = Type(ReceivingChannel)
    control_channel_class = Type(ReceivingChannel)


def configure_kernel_manager(receiving_channels: bool = True) -> None:
    """Kernels started in this process get CurveZMQ (when pyzmq has it) and, unless ``receiving_channels``
    is False (jupyter_client's own client, as ``tools/kernel_stress.py --stock-client`` compares),
    :class:`BookKernelClient`."""
    import zmq

    client = BookKernelClient if receiving_channels else AsyncKernelClient
    # the manager's client() builds client_factory, whose default follows client_class: set both
    AsyncKernelManager.client_class.default_value = f"{client.__module__}.{client.__name__}"
    AsyncKernelManager.client_factory.default_value = client
    if zmq.has("curve") and hasattr(KernelManager, "transport_encryption"):
        KernelManager.transport_encryption.default_value = "auto"


def setup(app):
    configure_kernel_manager()
    # The kernels inherit this process's environment: in them seqlib.notebook.interact precomputes
    # each control's outputs into a player that works on the static page (no widgets, no kernel).
    os.environ[STATIC_CONTROLS_ENV] = "1"
    return {"parallel_read_safe": True, "parallel_write_safe": True}
