"""The OpenAPI 3.1 document of the HTTP API, built from the proto's descriptors.

Paths come from the route table (service/http/routes.py), schemas from the
messages they carry, in the protobuf JSON mapping, and every description from
the proto's own comments (the descriptor set `make gen` writes with its source
information). Nothing here names an RPC or a message: the document follows the
contract.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from streamlog.v1 import streamlog_pb2 as pb

from service.http.routes import Route
from service.http.status import HTTP_STATUS

DESCRIPTOR_SET = "descriptors.binpb"
_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte", "contentEncoding": "base64"},
}
# Field numbers in descriptor.proto: the steps of a source location's path (file: messages,
# enums, services; message: fields, nested messages, nested enums; enum: values; service: methods).
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM, _ENUM_VALUE, _METHOD = 2, 3, 4, 2, 2


def comments() -> dict[str, str]:
    """Full name of each message, field, enum, enum value, service and method -> its comment."""
    # Beside the generated package's modules (protos/generate.py writes it there).
    data = (Path(pb.__file__).parents[1] / DESCRIPTOR_SET).read_bytes()
    found: dict[str, str] = {}
    for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        notes = _Notes(file, found)
        prefix = f"{file.package}." if file.package else ""
        notes.messages(file.message_type, prefix, (_MESSAGE,))
        notes.enums(file.enum_type, prefix, (_ENUM,))
        for i, service in enumerate(file.service):
            notes.note(f"{prefix}{service.name}", (_SERVICE, i))
            for j, method in enumerate(service.method):
                notes.note(f"{prefix}{service.name}.{method.name}", (_SERVICE, i, _METHOD, j))
    return found


class _Notes:
    """The comments of one proto file, by the path of what they describe in its descriptor."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto, found: dict[str, str]) -> None:
        self._by_path = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        self._found = found

    def note(self, name: str, path: tuple[int, ...]) -> None:
        text = self._by_path.get(path, "")
        if text:
            # Lines joined into paragraphs; blank lines keep them apart (CommonMark, as OpenAPI reads it).
            paragraphs = " ".join(line.strip() or "\n\n" for line in text.strip().splitlines())
            self._found[name] = paragraphs.replace(" \n\n ", "\n\n")

    def messages(self, items: Iterable[Any], scope: str, path: tuple[int, ...]) -> None:
        for i, message in enumerate(items):
            name, here = f"{scope}{message.name}", (*path, i)
            self.note(name, here)
            for j, field in enumerate(message.field):
                self.note(f"{name}.{field.name}", (*here, _FIELD, j))
            self.messages(message.nested_type, f"{name}.", (*here, _NESTED))
            self.enums(message.enum_type, f"{name}.", (*here, _NESTED_ENUM))

    def enums(self, items: Iterable[Any], scope: str, path: tuple[int, ...]) -> None:
        for i, enum in enumerate(items):
            name, here = f"{scope}{enum.name}", (*path, i)
            self.note(name, here)
            for j, value in enumerate(enum.value):
                self.note(f"{name}.{value.name}", (*here, _ENUM_VALUE, j))


class _Schemas:
    """Component schemas, collected from the messages the routes reach."""

    def __init__(self, notes: Mapping[str, str]) -> None:
        self.notes = notes
        self.components: dict[str, Any] = {}

    def ref(self, message: Descriptor) -> dict[str, str]:
        if message.name not in self.components:
            self.components[message.name] = {}  # placed first: recursive messages end here
            self.components[message.name] = self._message(message)
        return {"$ref": f"#/components/schemas/{message.name}"}

    def _message(self, message: Descriptor) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
        if message.full_name in self.notes:
            schema["description"] = self.notes[message.full_name]
        for field in message.fields:
            schema["properties"][field.name] = self.field(field)
        return schema

    def field(self, field: FieldDescriptor) -> dict[str, Any]:
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            value = self._single(message.fields_by_name["value"])
            schema: dict[str, Any] = {"type": "object", "additionalProperties": value}
        elif field.is_repeated:
            schema = {"type": "array", "items": self._single(field)}
        else:
            schema = self._single(field)
        note = self.notes.get(field.full_name)
        if note:
            # A $ref takes no siblings in older readers: the note goes beside it in an allOf.
            schema = (
                {"allOf": [schema], "description": note}
                if "$ref" in schema
                else {**schema, "description": note}
            )
        return schema

    def _single(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.message_type is not None:
            return self.ref(field.message_type)
        if field.enum_type is not None:
            return _enum(field.enum_type)
        if field.type in _INT64:
            # The JSON mapping writes 64-bit integers as strings; it reads numbers too.
            return {"type": ["string", "integer"], "format": "int64", "pattern": "^-?[0-9]+$"}
        return dict(_SCALARS[field.type])


def _enum(enum: EnumDescriptor) -> dict[str, Any]:
    return {"type": "string", "enum": [value.name for value in enum.values]}


_ERROR = {
    "type": "object",
    "description": "A refusal: the gRPC status code, its name and the message (google.rpc.Status).",
    "properties": {
        "code": {"type": "integer", "description": "The gRPC status code's number."},
        "status": {"type": "string", "enum": [code.name for code in HTTP_STATUS]},
        "message": {"type": "string"},
    },
    "required": ["code", "status", "message"],
}


def document(
    service: Any,
    routes: Iterable[Route],
    extra_paths: Mapping[str, Any],
    *,
    title: str,
    version: str,
) -> dict[str, Any]:
    """The OpenAPI document for `routes` of `service` (a service descriptor); `extra_paths` are
    path items of routes that are not RPCs."""
    notes = comments()
    schemas = _Schemas(notes)
    paths: dict[str, Any] = {}
    for route in routes:
        method = service.methods_by_name[route.rpc]
        operation: dict[str, Any] = {
            "operationId": route.rpc if route.http_method == "POST" else f"get{route.rpc}",
            "summary": route.rpc,
            "tags": [service.name],
            "description": notes.get(method.full_name, ""),
        }
        request = method.input_type
        if route.http_method == "POST":
            operation["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": schemas.ref(request)}},
            }
        else:
            operation["parameters"] = [
                {
                    "name": field.name,
                    "in": "path" if field.name in route.path_fields else "query",
                    "required": field.name in route.path_fields,
                    "schema": schemas.field(field),
                }
                for field in request.fields
                if field.name in route.path_fields or _query_field(field)
            ]
        reply = schemas.ref(method.output_type)
        if route.streaming:
            ok = {
                "description": f"Server-Sent Events, each with one {method.output_type.name} in JSON as its "
                "data; a last `error` event carries an Error if the call ends with one.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            }
        else:
            ok = {"description": method.output_type.name, "content": {"application/json": {"schema": reply}}}
        operation["responses"] = {
            "200": ok,
            "default": {
                "description": "Error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        }
        paths.setdefault(route.path, {})[route.http_method.lower()] = operation
    for path, item in extra_paths.items():
        paths.setdefault(path, {}).update(item)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": notes.get(service.full_name, "")},
        "security": [{}, {"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": {**dict(sorted(schemas.components.items())), "Error": _ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _query_field(field: FieldDescriptor) -> bool:
    """Fields a query parameter can set (routes.from_query takes scalars and repeated scalars)."""
    return field.message_type is None
