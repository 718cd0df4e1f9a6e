// The official MCP client calling the `charge` tool through `idem proxy`, the way an agent
// host should: the host mints one idempotency key per intended call, outside the model,
// and sends it again with every retry of that call.
//
//   node client.js http://127.0.0.1:8080/mcp
//
// It charges once, "loses" the answer, retries with the same key (a new JSON-RPC id, as
// every retry has), and prints both answers: the same charge.
const { randomUUID } = require("node:crypto");
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");

async function main() {
  const url = new URL(process.argv[2] ?? "http://127.0.0.1:8080/mcp");
  const client = new Client({ name: "idem-example-host", version: "1.0.0" });
  // The proxy keeps keys per caller: the Authorization header names the caller.
  const requestInit = { headers: { authorization: "Bearer alice" } };
  await client.connect(new StreamableHTTPClientTransport(url, { requestInit }));

  // One key per intended call, minted by the host when it decides to make the call.
  const idempotencyKey = randomUUID();
  const call = {
    name: "charge",
    arguments: { amount: 1250, currency: "EUR" },
    _meta: { idempotencyKey },
  };
  const first = await client.callTool(call);
  console.log("first: ", first.content[0].text);
  // Say the answer was lost (a timeout, a dropped stream): the host retries the same call
  // with the same key.
  const retry = await client.callTool(call);
  console.log("retry: ", retry.content[0].text);
  await client.close();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
