"""StreamLogService: the handlers of every RPC, composed from the parts that serve them.

Each part has one job and its own module:

- service/streams.py: Append, Read, and the streams' administration (ListStreams,
  GetStreamInfo, DeleteStream, Trim, SetStreamConfig, SeekTime, CountRange) and a
  single server's DescribeCluster and ReassignReplicas;
- service/subscriptions.py: Subscribe, plain and in group mode;
- service/groupdelivery.py: group reads (a Read naming a group, and the reads of
  Subscribe and Consume in group mode), Ack, Nack, Claim, AutoClaim;
- service/groupadmin.py: CreateGroup, DeleteGroup, ListGroups, GetGroupInfo,
  SetGroupOffset, SetGroupConfig, DeleteConsumer, GetPending;
- service/consume.py: Consume sessions;
- service/publish.py: Publish sessions, their messages coalesced into engine writes;
- service/appendmany.py: AppendMany, batches for many streams in one call.

They share a `Serving` (service/serving.py): the engine, the rule for calls that
may block on a sync, the reply budget, the subscription count and the drain
state. The server registers the handlers by the proto's method names
(server.method_handlers): an RPC added to the proto without one here fails at
start-up.
"""

from __future__ import annotations

from concurrent.futures import Executor

from service.appendmany import AppendManyCalls
from service.config import Settings
from service.consume import ConsumeCalls
from service.groupadmin import GroupAdmin
from service.groupdelivery import GroupDelivery
from service.groupwaits import GroupWaits
from service.publish import PublishCalls
from service.replybudget import ReplyBudget
from service.serving import Serving
from service.streams import StreamCalls
from service.subscriptions import Subscriptions
from service.waiters import Waiters
from storage import Engine


class StreamLogServicer:
    """The StreamLogService handlers. Create it, and call everything, on the server's event loop."""

    def __init__(self, settings: Settings, waiters: Waiters, executor: Executor) -> None:
        self._serving = serving = Serving(settings, waiters, executor)
        self._delivery = delivery = GroupDelivery(serving)
        streams = StreamCalls(serving, delivery)
        admin = GroupAdmin(serving, delivery.waits)
        self._consume = ConsumeCalls(serving, delivery)
        self._publish = PublishCalls(serving)

        self.Append = streams.Append
        self.AppendMany = AppendManyCalls(serving).AppendMany
        self.Publish = self._publish.Publish
        self.Read = streams.Read
        self.ListStreams = streams.ListStreams
        self.GetStreamInfo = streams.GetStreamInfo
        self.DeleteStream = streams.DeleteStream
        self.Trim = streams.Trim
        self.SetStreamConfig = streams.SetStreamConfig
        self.SeekTime = streams.SeekTime
        self.CountRange = streams.CountRange
        self.DescribeCluster = streams.DescribeCluster
        self.ReassignReplicas = streams.ReassignReplicas
        self.Subscribe = Subscriptions(serving, delivery).Subscribe
        self.Consume = self._consume.Consume
        self.Ack = delivery.Ack
        self.Nack = delivery.Nack
        self.Claim = delivery.Claim
        self.AutoClaim = delivery.AutoClaim
        self.CreateGroup = admin.CreateGroup
        self.DeleteGroup = admin.DeleteGroup
        self.ListGroups = admin.ListGroups
        self.GetGroupInfo = admin.GetGroupInfo
        self.SetGroupOffset = admin.SetGroupOffset
        self.SetGroupConfig = admin.SetGroupConfig
        self.DeleteConsumer = admin.DeleteConsumer
        self.GetPending = admin.GetPending

    @property
    def replies(self) -> ReplyBudget:
        """Bytes of replies built and not yet sent (service/replybudget.py)."""
        return self._serving.replies

    @property
    def subscriptions(self) -> int:
        """Open Subscribe and Consume calls."""
        return self._serving.subscriptions

    @property
    def group_waits(self) -> GroupWaits:
        """Blocked group readers, per group (service/groupwaits.py)."""
        return self._delivery.waits

    def attach_engine(self, engine: Engine) -> None:
        """Start serving from `engine` (opened and recovered); until then calls get UNAVAILABLE."""
        self._serving.attach_engine(engine)

    def listen_to(self, engine: Engine) -> None:
        """Register the wake-ups of blocked group readers with the engine (once per engine)."""
        self._delivery.listen_to(engine)

    def start_draining(self) -> None:
        """From now on, new calls get UNAVAILABLE and subscriptions end at their next step."""
        self._serving.draining = True
        self._consume.wake_all()
        self._publish.stop_all()
