"""factory-boy factories: datasource -> job -> binding -> run -> attempt."""

from __future__ import annotations

from typing import Any

import factory

from dispatch import services
from dispatch.models import Datasource, Job, JobBinding, Run


class DatasourceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Datasource

    name = factory.Sequence(lambda n: f"datasource-{n}")
    kind = "generate"
    config = factory.LazyFunction(dict)


class SinkFactory(DatasourceFactory):
    kind = "null"


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    name = factory.Sequence(lambda n: f"job-{n}")
    source_spec = factory.LazyFunction(lambda: {"rows": 10, "batch": 5})
    sink_spec = factory.LazyFunction(dict)
    max_attempts = 3
    backoff_seconds = 0.0
    backoff_max_seconds = 0.0
    lease_seconds = 30


class BindingFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = JobBinding

    name = factory.Sequence(lambda n: f"binding-{n}")
    job = factory.SubFactory(JobFactory)
    source = factory.SubFactory(DatasourceFactory)
    sink = factory.SubFactory(SinkFactory)


def trigger(binding: JobBinding | None = None, **kwargs: Any) -> Run:
    """A run through the real trigger path (run + attempt 1 in one transaction)."""
    return services.trigger(binding or BindingFactory(), **kwargs)
