"""Write schemas.json: the benchmark's JSON schemas, each with one valid instance
and one invalid instance that violates exactly one constraint (named in "violates").

Usage: .venv/bin/python benchmarks/structured_libs/make_schemas.py
Every valid instance is checked against its schema with jsonschema (formats
checked too), every invalid one must fail. Instances list properties in schema
order (all three libraries emit properties in declaration order).
"""
import json
import os

import jsonschema

HERE = os.path.dirname(os.path.abspath(__file__))

S = []


def add(name, schema, valid, invalid, violates):
    S.append(dict(name=name, schema=schema, valid=valid, invalid=invalid, violates=violates))


def obj(props, required=None, addl=False):
    d = {"type": "object", "properties": props,
         "required": list(props) if required is None else required}
    if addl is not None:
        d["additionalProperties"] = addl
    return d


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}

# 1 person: maxLength, int range, optional email (format), boolean
add("person",
    obj({"name": {"type": "string", "maxLength": 50},
         "age": {"type": "integer", "minimum": 0, "maximum": 150},
         "email": {"type": "string", "format": "email"},
         "is_active": BOOL}, required=["name", "age", "is_active"]),
    {"name": "Alice Johnson", "age": 34, "email": "alice.johnson@example.com", "is_active": True},
    {"name": "Alice Johnson", "age": 234, "email": "alice.johnson@example.com", "is_active": True},
    "maximum")

# 2 order with items, $defs/$ref, pattern, enum, minItems/maxItems, nullable
add("order_with_items", {
    "type": "object",
    "$defs": {
        "customer": obj({"id": {"type": "integer", "minimum": 1},
                         "name": {"type": "string", "maxLength": 80}}),
        "item": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                     "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                     "unit_price": {"type": "number", "minimum": 0}}),
    },
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {"$ref": "#/$defs/customer"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 10},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False},
    {"order_id": "ORD-004217", "customer": {"id": 8812, "name": "Bob Martinez"},
     "items": [{"sku": "KBD-1042", "quantity": 2, "unit_price": 49.99},
               {"sku": "MSE-0007", "quantity": 1, "unit_price": 19.5}],
     "status": "paid", "notes": None},
    {"order_id": "ORD-004217", "customer": {"id": 8812, "name": "Bob Martinez"},
     "items": [{"sku": "KBD-1042", "quantity": 2, "unit_price": 49.99},
               {"sku": "MSE-0007", "quantity": 1, "unit_price": 19.5}],
     "status": "refunded", "notes": None},
    "enum")

# 3 tool call: weather
add("tool_get_weather",
    obj({"location": {"type": "string", "description": "City and country"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 14}}, required=["location", "unit"]),
    {"location": "Paris, France", "unit": "celsius", "days": 3},
    {"location": "Paris, France", "unit": "celsius", "days": 30},
    "maximum")

# 4 tool call: web search with nested filters, maxItems, format date
add("tool_web_search",
    obj({"query": {"type": "string", "minLength": 1, "maxLength": 200},
         "top_k": {"type": "integer", "minimum": 1, "maximum": 50},
         "filters": obj({"domains": {"type": "array", "items": STR, "maxItems": 5},
                         "date_from": {"type": "string", "format": "date"}}, required=[]),
         "safe_search": BOOL}, required=["query"]),
    {"query": "jax pallas flash attention tutorial", "top_k": 5,
     "filters": {"domains": ["github.com", "docs.jax.dev"], "date_from": "2024-01-01"},
     "safe_search": True},
    {"query": "jax pallas flash attention tutorial", "top_k": 5,
     "filters": {"domains": ["a.com", "b.com", "c.com", "d.com", "e.com", "f.com"],
                 "date_from": "2024-01-01"}, "safe_search": True},
    "maxItems")

# 5 address with geo, number ranges via $defs
add("address_geo", {
    "$defs": {"geo": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "lon": {"type": "number", "minimum": -180, "maximum": 180}})},
    **obj({"street": STR, "city": STR,
           "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
           "country": {"type": "string", "enum": ["US", "CA", "MX", "GB", "FR", "DE"]},
           "geo": {"$ref": "#/$defs/geo"}})},
    {"street": "1600 Amphitheatre Pkwy", "city": "Mountain View", "postal_code": "94043",
     "country": "US", "geo": {"lat": 37.422, "lon": -122.084}},
    {"street": "1600 Amphitheatre Pkwy", "city": "Mountain View", "postal_code": "94043",
     "country": "US", "geo": {"lat": 137.422, "lon": -122.084}},
    "maximum (number)")

# 6 product catalog page
add("product_list",
    obj({"products": {"type": "array", "minItems": 1, "maxItems": 20, "items": obj({
        "id": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "maxLength": 120},
        "price": {"type": "number", "exclusiveMinimum": 0},
        "in_stock": BOOL,
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
        required=["id", "title", "price", "in_stock"])},
        "page": {"type": "integer", "minimum": 1}}),
    {"products": [{"id": 1, "title": "USB-C cable 2m", "price": 9.99, "in_stock": True,
                   "tags": ["cable", "usb"]},
                  {"id": 2, "title": "Laptop stand", "price": 34.0, "in_stock": False, "tags": []},
                  {"id": 3, "title": "Mechanical keyboard", "price": 89.5, "in_stock": True,
                   "tags": ["keyboard"]}], "page": 1},
    {"products": [{"id": 1, "title": "USB-C cable 2m", "price": 0, "in_stock": True,
                   "tags": ["cable", "usb"]}], "page": 1},
    "exclusiveMinimum")

# 7 calendar event: date-time formats, anyOf null/object
add("calendar_event", {
    "$defs": {"attendee": obj({"name": STR, "email": {"type": "string", "format": "email"},
                               "optional": BOOL}, required=["name", "email"])},
    **obj({"title": {"type": "string", "maxLength": 100},
           "start": {"type": "string", "format": "date-time"},
           "end": {"type": "string", "format": "date-time"},
           "attendees": {"type": "array", "items": {"$ref": "#/$defs/attendee"}, "maxItems": 8},
           "recurrence": {"anyOf": [{"type": "null"}, obj({
               "freq": {"enum": ["daily", "weekly", "monthly"]},
               "count": {"type": "integer", "minimum": 1, "maximum": 52}})]}})},
    {"title": "Sprint planning", "start": "2025-03-03T10:00:00Z", "end": "2025-03-03T11:00:00Z",
     "attendees": [{"name": "Dana", "email": "dana@corp.io", "optional": False},
                   {"name": "Eli", "email": "eli@corp.io"}],
     "recurrence": {"freq": "weekly", "count": 10}},
    {"title": "Sprint planning", "start": "next monday 10am", "end": "2025-03-03T11:00:00Z",
     "attendees": [{"name": "Dana", "email": "dana@corp.io", "optional": False},
                   {"name": "Eli", "email": "eli@corp.io"}],
     "recurrence": {"freq": "weekly", "count": 10}},
    "format date-time")

# 8 classification
add("sentiment",
    obj({"label": {"enum": ["positive", "negative", "neutral"]},
         "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    {"label": "positive", "confidence": 0.93},
    {"label": "positive", "confidence": 1.5},
    "maximum (number)")

# 9 NER
add("ner_entities",
    obj({"entities": {"type": "array", "items": obj({
        "text": STR, "type": {"enum": ["PERSON", "ORG", "LOC", "DATE", "MISC"]},
        "start": {"type": "integer", "minimum": 0}, "end": {"type": "integer", "minimum": 0}})}}),
    {"entities": [{"text": "Ada Lovelace", "type": "PERSON", "start": 0, "end": 12},
                  {"text": "London", "type": "LOC", "start": 26, "end": 32},
                  {"text": "1843", "type": "DATE", "start": 36, "end": 40}]},
    {"entities": [{"text": "Ada Lovelace", "type": "PERSON", "start": -3, "end": 12}]},
    "minimum")

# 10 feature flags: many booleans, nulls
add("feature_flags",
    obj({"dark_mode": BOOL, "beta_features": BOOL, "telemetry": BOOL, "new_checkout": BOOL,
         "max_upload_mb": {"type": ["integer", "null"]}, "rollout_group": {"type": "null"},
         "experiments": {"type": "array", "items": BOOL, "minItems": 3, "maxItems": 3}}),
    {"dark_mode": True, "beta_features": False, "telemetry": False, "new_checkout": True,
     "max_upload_mb": None, "rollout_group": None, "experiments": [True, False, True]},
    {"dark_mode": True, "beta_features": False, "telemetry": False, "new_checkout": True,
     "max_upload_mb": None, "rollout_group": None, "experiments": [True, False]},
    "minItems")

# 11 nested service config
add("service_config",
    obj({"server": obj({"host": STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": obj({"enabled": BOOL, "cert_path": {"type": ["string", "null"]}})}),
         "database": obj({"url": {"type": "string", "pattern": "^postgres://[^ ]+$"},
                          "pool_size": {"type": "integer", "minimum": 1, "maximum": 64},
                          "timeout_s": {"type": "number", "minimum": 0.1, "maximum": 300}}),
         "logging": obj({"level": {"enum": ["debug", "info", "warning", "error"]},
                         "json": BOOL})}),
    {"server": {"host": "0.0.0.0", "port": 8080, "tls": {"enabled": True,
                                                         "cert_path": "/etc/ssl/server.pem"}},
     "database": {"url": "postgres://app@db:5432/main", "pool_size": 16, "timeout_s": 2.5},
     "logging": {"level": "info", "json": True}},
    {"server": {"host": "0.0.0.0", "port": 80800, "tls": {"enabled": True,
                                                          "cert_path": "/etc/ssl/server.pem"}},
     "database": {"url": "postgres://app@db:5432/main", "pool_size": 16, "timeout_s": 2.5},
     "logging": {"level": "info", "json": True}},
    "maximum")

# 12 recursive tree ($ref to itself)
add("recursive_tree", {
    "$defs": {"node": obj({"name": STR, "children": {"type": "array",
                                                     "items": {"$ref": "#/$defs/node"}}},
                          required=["name"])},
    "$ref": "#/$defs/node"},
    {"name": "root", "children": [{"name": "src", "children": [{"name": "main.py"},
                                                               {"name": "util.py"}]},
                                  {"name": "README.md", "children": []}]},
    {"name": "root", "children": [{"name": "src", "kids": []}]},
    "additionalProperties")

# 13 anyOf discriminated shapes with const
add("shape_anyof",
    obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
        obj({"kind": {"const": "rect"}, "width": {"type": "number", "minimum": 0},
             "height": {"type": "number", "minimum": 0}})]},
        "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    {"shape": {"kind": "rect", "width": 3.5, "height": 2}, "color": "#ff8800"},
    {"shape": {"kind": "rect", "width": 3.5, "height": 2}, "color": "orange"},
    "pattern")

# 14 invoice
add("invoice", {
    "$defs": {"line": obj({"description": {"type": "string", "maxLength": 200},
                           "qty": {"type": "integer", "minimum": 1},
                           "unit_price": {"type": "number", "minimum": 0},
                           "tax_rate": {"type": "number", "minimum": 0, "maximum": 1}})},
    **obj({"invoice_no": {"type": "string", "pattern": "^INV-[0-9]{4}-[0-9]{5}$"},
           "issue_date": {"type": "string", "format": "date"},
           "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
           "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1},
           "paid": BOOL})},
    {"invoice_no": "INV-2025-00042", "issue_date": "2025-02-14", "currency": "EUR",
     "lines": [{"description": "GPU hours (H100)", "qty": 120, "unit_price": 2.1,
                "tax_rate": 0.2},
               {"description": "Storage, 1 TB-month", "qty": 3, "unit_price": 20,
                "tax_rate": 0.2}],
     "paid": False},
    {"invoice_no": "INV-2025-00042", "issue_date": "2025-02-14", "currency": "EUR",
     "lines": [], "paid": False},
    "minItems")

# 15 chat message: content anyOf string | array of parts
add("chat_message",
    obj({"role": {"enum": ["system", "user", "assistant", "tool"]},
         "content": {"anyOf": [STR, {"type": "array", "items": obj({
             "type": {"const": "text"}, "text": STR})}]},
         "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}}, required=["role", "content"]),
    {"role": "user", "content": [{"type": "text", "text": "Summarise this paper in 3 bullets."},
                                 {"type": "text", "text": "Focus on the method."}],
     "name": "alice_01"},
    {"role": "user", "content": 42, "name": "alice_01"},
    "anyOf/type")

# 16 github issue
add("github_issue",
    obj({"title": {"type": "string", "minLength": 5, "maxLength": 256},
         "body": STR,
         "labels": {"type": "array", "items": {"enum": ["bug", "enhancement", "docs", "question",
                                                        "good first issue"]}, "maxItems": 5},
         "assignees": {"type": "array", "items": {"type": "string",
                                                  "pattern": "^[a-z0-9-]{1,39}$"}},
         "milestone": {"type": ["integer", "null"], "minimum": 1}},
        required=["title", "body", "labels", "assignees", "milestone"]),
    {"title": "Paged attention kernel OOM on long prompts",
     "body": "Steps:\n1. run serve.py with --max-len 32768\n2. send a 30k-token prompt\n"
             "Expected: completes. Actual: RESOURCE_EXHAUSTED.",
     "labels": ["bug"], "assignees": ["jdoe", "mk-lee"], "milestone": 7},
    {"title": "OOM", "body": "x", "labels": ["bug"], "assignees": [], "milestone": 7},
    "minLength")

# 17 user profile with many optional fields
add("profile_many_optional",
    obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
         "display_name": STR, "bio": {"type": "string", "maxLength": 160},
         "website": {"type": "string", "format": "uri"}, "location": STR,
         "birth_year": {"type": "integer", "minimum": 1900, "maximum": 2025},
         "pronouns": STR, "verified": BOOL, "followers": {"type": "integer", "minimum": 0},
         "following": {"type": "integer", "minimum": 0}, "language": {"enum": ["en", "fr", "de",
                                                                              "es", "ja"]},
         "theme": {"enum": ["light", "dark", "system"]}}, required=["username"]),
    {"username": "carol_k", "bio": "Compilers, GPUs, coffee.", "location": "Berlin",
     "verified": False, "followers": 1234, "theme": "dark"},
    {"username": "carol_k", "bio": "Compilers, GPUs, coffee.", "location": "Berlin",
     "verified": False, "followers": 1234, "theme": "sepia"},
    "enum")

# 18 matrix: nested arrays with bounds
add("matrix",
    obj({"rows": {"type": "integer", "minimum": 2, "maximum": 4},
         "data": {"type": "array", "minItems": 2, "maxItems": 4,
                  "items": {"type": "array", "items": NUM, "minItems": 2, "maxItems": 4}}}),
    {"rows": 3, "data": [[1.0, 0.5, -2], [0, 1, 3.25], [7, -1.5, 0]]},
    {"rows": 3, "data": [[1.0, 0.5, -2, 4, 5], [0, 1, 3.25], [7, -1.5, 0]]},
    "maxItems")

# 19 string formats
add("string_formats",
    obj({"id": {"type": "string", "format": "uuid"}, "created": {"type": "string",
                                                                "format": "date-time"},
         "birthday": {"type": "string", "format": "date"},
         "contact": {"type": "string", "format": "email"},
         "homepage": {"type": "string", "format": "uri"}}),
    {"id": "3f2b8c1e-9a4d-4e7b-8c2a-1d5e6f7a8b9c", "created": "2024-11-05T08:15:30Z",
     "birthday": "1990-07-21", "contact": "h.tanaka@example.jp",
     "homepage": "https://example.jp/~tanaka"},
    {"id": "not-a-uuid", "created": "2024-11-05T08:15:30Z",
     "birthday": "1990-07-21", "contact": "h.tanaka@example.jp",
     "homepage": "https://example.jp/~tanaka"},
    "format uuid")

# 20 recipe
add("recipe",
    obj({"name": {"type": "string", "maxLength": 80},
         "servings": {"type": "integer", "minimum": 1, "maximum": 20},
         "vegetarian": BOOL,
         "ingredients": {"type": "array", "minItems": 1, "items": obj({
             "name": STR, "amount": {"type": "number", "exclusiveMinimum": 0},
             "unit": {"enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]}})},
         "steps": {"type": "array", "items": {"type": "string", "maxLength": 300},
                   "minItems": 1}}),
    {"name": "Tomato soup", "servings": 4, "vegetarian": True,
     "ingredients": [{"name": "tomatoes", "amount": 800, "unit": "g"},
                     {"name": "onion", "amount": 1, "unit": "piece"},
                     {"name": "olive oil", "amount": 2, "unit": "tbsp"}],
     "steps": ["Chop the onion and fry it in the oil for 5 minutes.",
               "Add the tomatoes, simmer 20 minutes, blend."]},
    {"name": "Tomato soup", "servings": 4, "vegetarian": True,
     "ingredients": [{"name": "tomatoes", "amount": 800, "unit": "pound"}],
     "steps": ["Chop."]},
    "enum")

# 21 log entry with free-form map (additionalProperties schema)
add("log_entry",
    obj({"timestamp": {"type": "string", "format": "date-time"},
         "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
         "message": {"type": "string", "maxLength": 500},
         "context": {"type": "object", "additionalProperties": {"type": "string"}}}),
    {"timestamp": "2025-01-09T23:59:59Z", "level": "ERROR",
     "message": "request failed after 3 retries",
     "context": {"request_id": "a1b2c3", "route": "/v1/completions", "status": "503"}},
    {"timestamp": "2025-01-09T23:59:59Z", "level": "ERROR",
     "message": "request failed after 3 retries", "context": {"request_id": 17}},
    "additionalProperties type")

# 22 SQL tool: anyOf of scalars incl. null
add("tool_sql_query",
    obj({"query": {"type": "string", "maxLength": 2000},
         "params": {"type": "array", "items": {"anyOf": [STR, NUM, BOOL, {"type": "null"}]}},
         "read_only": {"const": True}}),
    {"query": "SELECT id, name FROM users WHERE created_at > $1 AND active = $2 LIMIT $3",
     "params": ["2025-01-01", True, 50, None], "read_only": True},
    {"query": "DELETE FROM users", "params": [], "read_only": False},
    "const")

# 23 flight booking
add("flight_booking", {
    "$defs": {"passenger": obj({"first_name": {"type": "string", "maxLength": 40},
                                "last_name": {"type": "string", "maxLength": 40},
                                "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-F]$"},
                                "age_group": {"enum": ["adult", "child", "infant"]}},
                               required=["first_name", "last_name", "age_group"])},
    **obj({"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
           "date": {"type": "string", "format": "date"},
           "cabin": {"enum": ["economy", "premium_economy", "business", "first"]},
           "passengers": {"type": "array", "items": {"$ref": "#/$defs/passenger"},
                          "minItems": 1, "maxItems": 9}})},
    {"flight": "LH454", "date": "2025-06-12", "cabin": "economy",
     "passengers": [{"first_name": "Jan", "last_name": "Nowak", "seat": "23C",
                     "age_group": "adult"},
                    {"first_name": "Zofia", "last_name": "Nowak", "seat": "23D",
                     "age_group": "child"}]},
    {"flight": "LH454", "date": "2025-06-12", "cabin": "economy",
     "passengers": [{"first_name": "Jan", "last_name": "Nowak", "seat": "23K",
                     "age_group": "adult"}]},
    "pattern")

# 24 API envelope: anyOf [$ref, null]
add("api_envelope", {
    "$defs": {"user": obj({"id": {"type": "integer"}, "login": STR,
                           "roles": {"type": "array", "items": {"enum": ["admin", "dev",
                                                                         "viewer"]}}})},
    **obj({"ok": BOOL, "data": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]},
           "error": {"anyOf": [obj({"code": {"type": "integer", "minimum": 400,
                                             "maximum": 599},
                                    "message": STR}), {"type": "null"}]}})},
    {"ok": True, "data": {"id": 42, "login": "octo", "roles": ["dev", "viewer"]}, "error": None},
    {"ok": False, "data": None, "error": {"code": 200, "message": "fine"}},
    "minimum")

# 25 long enum (country codes)
COUNTRIES = ["AR", "AT", "AU", "BE", "BR", "CA", "CH", "CL", "CN", "CO", "CZ", "DE", "DK", "EG",
             "ES", "FI", "FR", "GB", "GR", "HK", "HU", "ID", "IE", "IL", "IN", "IT", "JP", "KE",
             "KR", "MX", "MY", "NG", "NL", "NO", "NZ", "PE", "PH", "PK", "PL", "PT", "RO", "RU",
             "SA", "SE", "SG", "TH", "TR", "TW", "UA", "US", "VN", "ZA"]
add("country_enum",
    obj({"country": {"enum": COUNTRIES}, "visited": {"type": "array",
                                                     "items": {"enum": COUNTRIES},
                                                     "maxItems": 10}}),
    {"country": "JP", "visited": ["KR", "TW", "US", "FR"]},
    {"country": "XX", "visited": []},
    "enum")

# 26 long bounded text (minLength/maxLength large)
add("summary_long_text",
    obj({"summary": {"type": "string", "minLength": 20, "maxLength": 1000},
         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 30},
                      "minItems": 3, "maxItems": 8}}),
    {"summary": "The paper introduces a paged KV cache for LLM serving that stores attention "
                "keys and values in fixed-size blocks, reducing fragmentation and enabling "
                "prefix sharing across requests; throughput improves 2-4x at equal latency.",
     "keywords": ["kv cache", "paging", "llm serving", "throughput"]},
    {"summary": "Too short.", "keywords": ["kv cache", "paging", "llm serving"]},
    "minLength")

# 27 additionalProperties not set (open object): extra keys allowed by JSON Schema
add("open_object",
    {"type": "object", "properties": {"id": INT, "name": STR}, "required": ["id"]},
    {"id": 7, "name": "seven", "extra": [1, 2, 3]},
    {"name": "seven"},
    "required")


def main():
    fc = jsonschema.FormatChecker()
    for s in S:
        cls = jsonschema.validators.validator_for(s["schema"])
        cls.check_schema(s["schema"])
        v = cls(s["schema"], format_checker=fc)
        errs = list(v.iter_errors(s["valid"]))
        assert not errs, (s["name"], errs)
        assert list(v.iter_errors(s["invalid"])), (s["name"], "invalid instance validates")
    with open(os.path.join(HERE, "schemas.json"), "w") as f:
        json.dump(S, f, indent=1)
    print(f"wrote {len(S)} schemas")


if __name__ == "__main__":
    main()
