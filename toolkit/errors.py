"""The one error hierarchy of hpcmem.

Every failure a user can cause or fix (bad input, a scheduler refusing a job, an
unknown site) is an ``HpcmemError``; the CLI prints it as one line and exits
non-zero. Anything else is a bug and keeps its traceback.
"""


class HpcmemError(Exception):
    """Base of every error hpcmem reports to a person as one line."""

    exit_code = 2


class ConfigError(HpcmemError):
    """A site profile, job spec or option is malformed (names the file and key)."""


class UnknownNameError(ConfigError):
    """A site, partition, job or knob that does not exist; lists the valid ones."""

    def __init__(self, what: str, name: str, valid):
        valid = sorted(valid)
        super().__init__(f"unknown {what} {name!r}; valid: {', '.join(valid) if valid else '(none)'}")
        self.what, self.name, self.valid = what, name, valid


class PlanError(ConfigError):
    """A plan that breaks the batch invariant or asks what the partition cannot do."""


class RenderError(HpcmemError):
    """A template could not be rendered (missing value, bad template)."""


class CommandError(HpcmemError):
    """An external command failed; carries argv, exit code, stdout and stderr."""

    def __init__(self, argv, returncode, stdout="", stderr="", message=None):
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout or ""
        self.stderr = stderr or ""
        detail = (self.stderr.strip() or self.stdout.strip()).splitlines()
        detail = detail[-1] if detail else ""
        text = message or f"{self.argv[0]} failed (exit {returncode})"
        super().__init__(f"{text}: {detail}" if detail else text)


class SchedulerError(HpcmemError):
    """The scheduler refused or could not answer (after bounded retries)."""


class MaybeSubmittedError(SchedulerError):
    """A submission whose outcome is not known: sbatch timed out, or the controller could not be reached.

    The job may exist. The controller keeps the attempt ``submitting`` and the next tick looks
    the job up by its unique name before submitting again; it never counts as a refusal.
    """


class LedgerError(HpcmemError):
    """The ledger is locked, unreadable or of an unknown version."""
