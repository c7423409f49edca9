"""The bound on queued work: sequences in flight may not exceed running slots + --max-queued-requests."""

from __future__ import annotations

from cpllm.server.errors import APIError, bad_request


class Admission:
    """Counts the sequences (prompts x n) of accepted requests until they close. Event-loop thread only."""

    def __init__(self, running_slots: int, max_queued: int, retry_after_s: int):
        self.limit = running_slots + max_queued
        """Most sequences in flight at once: those that can run plus those allowed to wait."""
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        """Sequences admitted and not yet released."""

    def admit(self, sequences: int) -> "Ticket":
        """A ticket for `sequences` more; 429 (with Retry-After) when the queue is full, 400 if it never fits."""
        if sequences > self.limit:
            raise bad_request(f"this request needs {sequences} sequences (prompts x n), more than the server ever "
                              f"runs or queues at once ({self.limit})", "n")
        if self.in_flight + sequences > self.limit:
            raise APIError(429, f"the server is busy: {self.in_flight} sequences are in flight and at most "
                                f"{self.limit} may be ({self.max_queued} waiting, --max-queued-requests); "
                                f"retry in {self.retry_after_s} s",
                           code="too_many_requests", headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += sequences
        return Ticket(self, sequences)


class Ticket:
    """Admitted sequences; `release()` (idempotent) gives them back."""

    def __init__(self, admission: Admission, sequences: int):
        self._admission = admission
        self._sequences = sequences

    def release(self) -> None:
        self._admission.in_flight -= self._sequences
        self._sequences = 0
