"""What operators do to an outbox, from the command line and the console alike: dead letters
(``dead``), the archive (``archive``: replay, purge), the audit trail of both (``audit``), the
status report (``status``) and the grants audit (``grants``)."""
