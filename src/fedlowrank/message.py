"""What travels between server and clients, and what each side keeps.

* :class:`Message` — a flat mapping of names to tensors and small scalars. The runtime serialises it and
  counts ``Message.nbytes()`` in the communication ledger; a method never reports its own cost.
* :class:`State` — explicit, serialisable server or client state (same container, same format).
* :class:`Reply` — a client's message as the server receives it, with the client id and its data size.

Reserved message keys written by :meth:`fedlowrank.methods.base.Method.train` replies:
``num_examples`` (int) and ``train_loss`` (float).
"""

from __future__ import annotations

from dataclasses import dataclass

from .serialization import TensorDict


class Message(TensorDict):
    """A flat ``name -> Tensor | scalar`` mapping sent in one direction for one client in one round."""


class State(TensorDict):
    """Server or client state: ``name -> Tensor | scalar``; ``state_dict()``/``load_state_dict()`` round-trip."""


@dataclass
class Reply:
    """One client's upload as the server sees it.

    Attributes:
        client: client id in ``[0, num_clients)``.
        num_examples: the client's local data size (the default FedAvg weight).
        message: the uploaded :class:`Message`.
    """

    client: int
    num_examples: int
    message: Message
