// The API's reference from /openapi.json, drawn here: no script or style from elsewhere, so /docs works
// without internet (the description is the same document Swagger UI would read).

const SCHEMA_PREFIX = "#/components/schemas/";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function schemaLink(ref) {
  const name = ref.slice(SCHEMA_PREFIX.length);
  return el("a", { href: `#schema-${name}` }, name);
}

// A schema as text and links: a $ref links to its entry below, arrays and unions say what they hold.
function typeOf(schema) {
  if (!schema) return "";
  if (schema.$ref) return schemaLink(schema.$ref);
  const span = el("span");
  const parts = schema.anyOf || schema.oneOf;
  if (parts) {
    parts.forEach((part, i) => span.append(i ? " | " : "", typeOf(part)));
  } else if (schema.type === "array") {
    span.append("array of ", typeOf(schema.items));
  } else if (schema.enum) {
    span.append(schema.enum.map((v) => JSON.stringify(v)).join(" | "));
  } else {
    span.append(schema.type || "any");
  }
  return span;
}

function fieldsTable(schema) {
  const required = new Set(schema.required || []);
  const table = el("table");
  for (const [name, field] of Object.entries(schema.properties || {})) {
    const label = required.has(name) ? `${name} *` : name;
    const byDefault = field.default !== undefined ? `default ${JSON.stringify(field.default)}` : "";
    const notes = [field.description || "", byDefault];
    table.append(el("tr", {}, el("td", {}, label), el("td", {}, typeOf(field)),
                    el("td", { class: "muted" }, notes.filter(Boolean).join("; "))));
  }
  return table;
}

function bodySchema(content) {
  const json = content && (content["application/json"] || Object.values(content)[0]);
  return json && json.schema;
}

function routeEntry(path, method, op) {
  const id = `route-${method}-${path}`;
  const entry = el("article", { class: "route", id },
                   el("h3", {}, el("span", { class: `method ${method}` }, method.toUpperCase()), path));
  if (op.summary || op.description) entry.append(el("p", {}, op.description || op.summary));
  const body = op.requestBody && bodySchema(op.requestBody.content);
  if (body) entry.append(el("p", {}, "Body: ", typeOf(body)));
  for (const [status, response] of Object.entries(op.responses || {})) {
    const schema = bodySchema(response.content);
    entry.append(el("p", { class: "muted" }, `${status} ${response.description || ""} `, schema ? typeOf(schema) : ""));
  }
  return entry;
}

function render(api) {
  document.title = `${api.info.title} ${api.info.version} API`;
  document.getElementById("title").replaceChildren(api.info.title, " ", el("span", {}, `${api.info.version} API`));
  document.getElementById("description").textContent = api.info.description || "";
  const toc = document.getElementById("toc");
  const routes = document.getElementById("routes");
  for (const [path, methods] of Object.entries(api.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      toc.append(el("a", { href: `#route-${method}-${path}` }, `${method.toUpperCase()} ${path}`));
      routes.append(routeEntry(path, method, op));
    }
  }
  const schemas = document.getElementById("schemas");
  for (const [name, schema] of Object.entries((api.components || {}).schemas || {})) {
    const entry = el("article", { class: "schema", id: `schema-${name}` }, el("h3", {}, name));
    if (schema.description) entry.append(el("p", {}, schema.description));
    entry.append(schema.properties ? fieldsTable(schema) : el("p", {}, typeOf(schema)));
    schemas.append(entry);
  }
}

fetch("/openapi.json")
  .then((response) => response.json())
  .then(render)
  .catch((error) => { document.getElementById("description").textContent = `cannot read /openapi.json: ${error}`; });
