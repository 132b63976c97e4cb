"""The HTTP API: one router per job (probes, embeddings, encode, each tier's routes), the encode steps they share,
the inputs as a request writes them, and the models that document every answer. Routes read what they serve from
(`Served`) on the app's state; errors they raise are domain errors (service/errors.py), turned into HTTP by
service/http_errors.py."""
