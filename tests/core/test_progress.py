"""Progress lines: pace and time left, one updating line on a terminal, throttled plain lines in a log,
nothing under -q."""

from pytest_kvoffload.core.progress import PLAIN_EVERY_S, ProgressLine, Tracker, eta


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Reporter:
    def __init__(self, tty):
        self.tty, self.out = tty, []

    def isatty(self):
        return self.tty

    def ensure_newline(self):
        self.out.append(("newline",))

    def rewrite(self, line, erase=False):
        self.out.append(("rewrite", line))

    def write(self, text):
        self.out.append(("write", text))

    def write_line(self, line):
        self.out.append(("line", line))


def test_eta_from_the_pace_so_far():
    assert eta(10.0, 1, 4) == "10 s, about 30 s left"
    assert eta(10.0, 0, 4) == "10 s" and eta(40.0, 4, 4) == "40 s"


def test_tracker_says_done_of_total_with_time_left_and_ends_with_a_plain_line():
    said, clock = [], Clock()
    tracker = Tracker(lambda m, update=False: said.append((m, update)), "admission grid", 3, "cells", clock)
    clock.now = 5.0
    tracker.step("384 tokens")
    clock.now = 10.0
    tracker.step()
    tracker.step()
    assert said[0] == ("admission grid: 1/3 cells (384 tokens), 5 s, about 10 s left", True)
    assert said[-1] == ("admission grid: 3/3 cells, 10 s", False)


def test_one_step_is_not_a_phase():
    said = []
    Tracker(lambda m, update=False: said.append(m), "grid", 1).step()
    assert said == []


def test_terminal_gets_one_updating_line_then_a_newline():
    reporter = Reporter(tty=True)
    say = ProgressLine(reporter)
    say("a: 1/2", update=True)
    say("a: 2/2")
    assert reporter.out == [("newline",), ("rewrite", "[kvoffload] a: 1/2"), ("rewrite", "[kvoffload] a: 2/2"),
                            ("write", "\n")]


def test_log_gets_plain_lines_at_most_every_few_seconds():
    reporter, clock = Reporter(tty=False), Clock()
    say = ProgressLine(reporter, clock=clock)
    say("1", update=True)
    clock.now = PLAIN_EVERY_S / 2
    say("2", update=True)  # too soon after the last: dropped
    clock.now = PLAIN_EVERY_S * 1.5
    say("3", update=True)
    say("done")  # a phase's last line is always written
    assert [line for _, line in reporter.out] == ["[kvoffload] 1", "[kvoffload] 3", "[kvoffload] done"]


def test_quiet_says_nothing():
    reporter = Reporter(tty=False)
    ProgressLine(reporter, quiet=True)("anything")
    assert reporter.out == []


def test_time_left_follows_the_work_when_steps_differ_in_cost():
    said, clock = [], Clock()
    tracker = Tracker(lambda m, update=False: said.append(m), "grid", 2, "lengths", clock, total_work=512 + 4096)
    clock.now = 1.0
    tracker.step("512 tokens", work=512)  # 1 s for 512 of 4,608 tokens: 8 s left, not 1 s
    assert said == ["grid: 1/2 lengths (512 tokens), 1 s, about 8 s left"]
