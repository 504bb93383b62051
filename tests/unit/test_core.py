"""The client core (clients/_core.py) on its own: every life event in every state, against a
table written here independently of the module's; the in-flight table and the tallies through
posts, answers, outages and re-attachments. Pure: no transport, no loop, no clock."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from kalos.broker.errors import BrokerUnavailable, ClosedError, ForkedPoolError, ProtocolError
from kalos.clients._core import ClientCore, Life, Step, Tally
from kalos.clients._exchange import Exchange
from kalos.clients._life import Driver, PoolState
from kalos.clients._writes import WriteCall

S = PoolState
ALL = list(S)

# What each event does in each state: (state after, step) or an exception class. Written from the
# behaviour the drivers promise (README "API", the pool's docstring), not from the module.
CLOSE = {
    S.NEW: (S.CLOSED, Step.NOTHING),
    S.OPEN: (S.CLOSING, Step.WAIT),
    S.CLOSING: (S.CLOSING, Step.WAIT),
    S.CLOSED: (S.CLOSED, Step.NOTHING),
    S.BROKEN: (S.BROKEN, Step.TERMINATE),  # terminate() then closes it
    S.FORKED: (S.FORKED, Step.NOTHING),  # the parent's slots: nothing to do
}
TERMINATE = {
    S.NEW: (S.CLOSED, Step.TERMINATE),
    S.OPEN: (S.CLOSED, Step.TERMINATE),
    S.CLOSING: (S.CLOSED, Step.TERMINATE),
    S.CLOSED: (S.CLOSED, Step.NOTHING),
    S.BROKEN: (S.CLOSED, Step.TERMINATE),
    S.FORKED: (S.CLOSED, Step.NOTHING),
}
BREAK = {s: (S.BROKEN if s in (S.OPEN, S.CLOSING) else s) for s in ALL}


def life_in(state: PoolState, driver: Driver = Driver.POOL) -> Life:
    life = Life(100, driver)
    life.state = state
    return life


@pytest.mark.parametrize("state", ALL)
def test_open_only_from_new(state):
    life = life_in(state)
    if state is S.NEW:
        life.open()
        assert life.state is S.OPEN
    else:
        with pytest.raises(ClosedError, match=f"pool is {state.value}: a pool is opened once"):
            life.open()
        assert life.state is state


@pytest.mark.parametrize("state", ALL)
def test_close_terminate_fork_and_break_in_every_state(state):
    life = life_in(state)
    assert (life.close(), life.state) == (CLOSE[state][1], CLOSE[state][0])
    life = life_in(state)
    assert (life.terminate(), life.state) == (TERMINATE[state][1], TERMINATE[state][0])
    life = life_in(state)
    life.fork()
    assert life.state is S.FORKED
    life = life_in(state)
    cause = BrokerUnavailable("gone")
    life.break_(cause)
    assert life.state is BREAK[state] and life.broken is cause


@pytest.mark.parametrize("state,driver", list(itertools.product(ALL, Driver)))
def test_what_a_call_raises_in_every_state(state, driver):
    life = life_in(state, driver)
    cause = ProtocolError("another geometry")
    life.broken = cause if state is S.BROKEN else None
    err = life.refusal(101)
    if state is S.OPEN:
        assert err is None
    elif state is S.BROKEN:
        assert err is cause
    elif state is S.FORKED:
        assert isinstance(err, ForkedPoolError) and "process 100" in str(err) and "process 101" in str(err)
        assert driver.value in str(err)
    else:
        assert isinstance(err, ClosedError) and driver.value in str(err)
    assert life.serving is (state in (S.OPEN, S.CLOSING))


def test_a_whole_life_then_every_call_after_closing_is_refused():
    life = Life(7)
    assert isinstance(life.refusal(7), ClosedError)
    life.open()
    assert life.refusal(7) is None
    assert life.close() is Step.WAIT and life.refusal(7) is not None  # no new calls while closing
    assert life.terminate() is Step.TERMINATE and life.state is S.CLOSED
    assert life.close() is Step.NOTHING and life.terminate() is Step.NOTHING


def exchange(index: int, call: WriteCall | None = None) -> Exchange[Any, str]:
    return Exchange(SimpleNamespace(index=index), SimpleNamespace(call=call), f"waiter{index}")  # type: ignore[arg-type]


def test_the_in_flight_table_keeps_posting_order_and_counts_posts():
    core: ClientCore[str] = ClientCore(Life(1))
    table = core.inflight
    for i in (3, 0, 2):
        core.posted(exchange(i))
    assert list(core.inflight) == [3, 0, 2] and core.oldest().slot.index == 3
    assert core.tally.posted == 3
    assert core.answered(0).waiter == "waiter0"
    assert list(core.inflight) == [3, 2] and core.oldest().slot.index == 3
    core.answered(3)
    assert core.oldest().slot.index == 2
    assert core.inflight is table  # the table a driver binds stays the core's
    with pytest.raises(KeyError):
        core.answered(3)  # answered once


def test_lost_exchanges_leave_the_table_and_stop_their_write_calls():
    core: ClientCore[str] = ClientCore(Life(1))
    call = WriteCall()
    core.posted(exchange(1, call))
    core.posted(exchange(2))
    lost = core.lost()
    assert [e.slot.index for e in lost] == [1, 2] and core.inflight == {}
    assert call.failed  # no further chunk of that write is posted
    assert core.lost() == []


@pytest.mark.parametrize("state,attached,reconnect", list(itertools.product(ALL, (False, True), (False, True))))
def test_an_outage_in_every_state(state, attached, reconnect):
    core: ClientCore[str] = ClientCore(life_in(state))
    step = core.outage(attached, reconnect, now_ns=5_000)
    if state not in (S.OPEN, S.CLOSING) or not attached:
        expected = Step.NOTHING  # already down, or not serving: nothing more to do
    elif not reconnect:
        expected = Step.BREAK
    else:
        expected = Step.REATTACH
    assert step is expected
    assert core.tally.outages == (1 if expected is Step.REATTACH else 0)
    assert core.tally.down_since == (5_000 if expected is Step.REATTACH else 0)
    assert core.life.state is state  # the driver breaks it (Life.break_) with the cause


def test_unavailable_time_adds_up_over_outages_and_counts_the_current_one():
    core: ClientCore[str] = ClientCore(life_in(S.OPEN))
    assert core.tally.unavailable_s(10**9) == 0.0
    assert core.outage(True, True, now_ns=1 * 10**9) is Step.REATTACH
    assert core.tally.unavailable_s(3 * 10**9) == pytest.approx(2.0)  # down now, for 2 s
    assert core.reattached(4 * 10**9) is Step.INSTALL
    assert core.tally.reattaches == 1 and core.tally.down_since == 0
    assert core.tally.unavailable_s(9 * 10**9) == pytest.approx(3.0)  # over: stays 3 s
    core.outage(True, True, now_ns=10 * 10**9)
    assert core.tally.unavailable_s(10_500_000_000) == pytest.approx(3.5)
    assert core.tally.outages == 2


@pytest.mark.parametrize("state", ALL)
def test_a_reattachment_is_installed_only_while_serving(state):
    core: ClientCore[str] = ClientCore(life_in(state))
    core.tally.down_since = 1
    step = core.reattached(11)
    if state in (S.OPEN, S.CLOSING):
        assert step is Step.INSTALL and core.tally.reattaches == 1 and core.tally.unavailable_ns == 10
    else:
        assert step is Step.END and core.tally.reattaches == 0 and core.tally.unavailable_ns == 0


def test_answers_are_tallied_per_caller():
    t = Tally()
    t.answered(1, ok=True, shared=False)
    t.answered(3, ok=True, shared=True)
    t.answered(2, ok=False, shared=True)
    t.answered(1, ok=False, shared=False)
    assert (t.requests, t.coalesced, t.errors) == (7, 5, 3)


def test_a_forked_core_forgets_the_parents_exchanges():
    core: ClientCore[str] = ClientCore(life_in(S.OPEN))
    core.posted(exchange(4))
    core.forget()
    assert core.inflight == {} and core.life.state is S.FORKED
    assert isinstance(core.life.refusal(2), ForkedPoolError)
