// The official MCP client (`@modelcontextprotocol/sdk`, from examples/mcp through
// NODE_PATH) driving one case against `idem proxy`; it prints what it saw as one JSON line.
//
//   node mcp_client.js <case> <mcp url> <key>
//
// Cases: `retry` (a call, then its retry with the same key: the SDK only accepts an answer
// carrying the id it sent), `burst` (20 concurrent copies), `mismatch` (the key reused with
// other arguments), `passthrough` (tools/list twice and a notification), `nokey`.
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");

const [, , which, url, key] = process.argv;

async function connect() {
  // Roots, so that the client may send its notification.
  const capabilities = { roots: { listChanged: true } };
  const client = new Client({ name: "idem-test-host", version: "1.0.0" }, { capabilities });
  const requestInit = { headers: { authorization: "Bearer alice" } };
  await client.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit }));
  return client;
}

// A call's answer as data: its text, or its JSON-RPC error's code and data.
async function answer(promise) {
  try {
    const result = await promise;
    return { text: result.content[0].text, isError: result.isError ?? false };
  } catch (e) {
    return { code: e.code, message: e.message, data: e.data ?? null };
  }
}

function charge(client, amount, meta, extra = {}) {
  const call = { name: "charge", arguments: { amount, currency: "EUR", ...extra } };
  if (meta) call._meta = meta;
  return answer(client.callTool(call));
}

const cases = {
  async retry(client) {
    const first = await charge(client, 1250, { idempotencyKey: key, progressToken: 1 });
    // A new id (the client numbers its requests) and a new progress token.
    const retry = await charge(client, 1250, { idempotencyKey: key, progressToken: 2 });
    // Another connection, as a host restarted after a crash: its ids start over.
    const other = await connect();
    const again = await charge(other, 1250, { idempotencyKey: key });
    await other.close();
    return { first, retry, again };
  },
  async burst(client) {
    const copies = Array.from({ length: 20 }, () =>
      charge(client, 700, { idempotencyKey: key }, { delay_ms: 500 }),
    );
    return { answers: await Promise.all(copies) };
  },
  async mismatch(client) {
    const first = await charge(client, 5, { idempotencyKey: key });
    const other = await charge(client, 500, { idempotencyKey: key });
    return { first, other };
  },
  async passthrough(client) {
    const lists = [];
    for (let i = 0; i < 2; i++) {
      lists.push((await client.listTools()).tools.map((t) => t.name));
    }
    await client.sendRootsListChanged();
    await client.ping();
    return { lists };
  },
  async nokey(client) {
    return { first: await charge(client, 9, null), second: await charge(client, 9, null) };
  },
};

(async () => {
  const client = await connect();
  const out = await cases[which](client);
  await client.close();
  console.log(JSON.stringify(out));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
