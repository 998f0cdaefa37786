"""REST/JSON API over a Unix socket (design §2), its models and its OpenAPI document."""
