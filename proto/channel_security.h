// Transport security shared by the coordinator, the workers and shardctl: TLS (mutual when the
// coordinator names a client CA) and the bearer tokens that authorise calls. Tokens are read
// from files, sent as "authorization: Bearer ..." metadata on every call and never logged.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cli.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace shard {

// The metadata key carrying "Bearer <token>".
inline constexpr char kAuthorizationHeader[] = "authorization";

// What a client connects with, the files read.
struct ClientSecurity {
  std::string root_ca_pem;  // empty: plaintext
  std::string cert_pem;
  std::string key_pem;
  std::string server_name;
  std::string token;
};

// Reads and checks the files: a certificate needs its key (and TLS), a token file must hold one
// non-empty line of printable ASCII of at most 4096 bytes.
absl::StatusOr<ClientSecurity> LoadClientSecurity(const ClientSecurityFiles& files);

// A channel to `address` with TLS if configured and the token attached to every call.
std::shared_ptr<grpc::Channel> CreateSecureChannel(const std::string& address,
                                                   const ClientSecurity& security,
                                                   grpc::ChannelArguments args = {});

// The coordinator's files: --tls-cert, --tls-key, --tls-client-ca.
struct ServerSecurityFiles {
  std::string cert;
  std::string key;
  std::string client_ca;  // set: clients must present a certificate it signed
};

// Server credentials: TLS when a certificate is given (mutual with a client CA), else
// plaintext. A key without a certificate, or a client CA without TLS, is an error.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> LoadServerCredentials(
    const ServerSecurityFiles& files);

// A token from a file (see LoadClientSecurity for the rules); the message names the file and
// never the content.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Whether `presented` equals `expected`, in time independent of where they differ.
bool TokensEqual(absl::string_view presented, absl::string_view expected);

}  // namespace shard
