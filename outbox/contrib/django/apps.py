from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Transactional outbox"
